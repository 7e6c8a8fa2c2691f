"""The engine: arguments and configuration, the core loop (scheduler + model runner),
its separate process for the server, and the front end that turns requests into outputs.
"""
