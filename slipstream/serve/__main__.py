"""`python -m slipstream.serve ...` == `slipstream serve ...`."""
from slipstream.serve.cli import main

main()
