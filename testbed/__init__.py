"""A simulated two-node (or N-node) DGX Spark cluster on one Linux machine, for tests, benchmarks and demos.

Each node is a network namespace with its own sshd, dockerd (and containerd) and model filesystem. The
reconciler talks to the nodes exactly as it would talk to real Sparks: over SSH, through the head as jump
host for the worker. See docs/testbed.md for what is real, what is a stand-in, and the limits.

Public entry points live in :mod:`testbed.api`; ``python -m testbed --help`` is the CLI.
"""
