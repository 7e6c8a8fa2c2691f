"""The `slipstream bench` subcommands: offline throughput and latency runs, the online
serving benchmark, their datasets and the JSON reports they write.
"""
