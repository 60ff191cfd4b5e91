"""What the commands bench, plan and check share: the workload contract (``--entry``) and starting
a job under torchrun from a command, with a timeout, and reading its result. Imports no torch at import time."""
