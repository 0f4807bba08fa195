"""The daemon: the supervisor (`supervisor.Daemon`), the worker process
(`worker`), and the `serve` and `status` commands."""
