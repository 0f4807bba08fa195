"""The daemon: the supervisor (`supervisor.Daemon`), the worker process
(`worker`), and the `serve` and `status` commands."""

if __name__ != "superfluid.daemon":  # imported by its bare name from a checkout's root: not ours
    from superfluid.checkout import not_ours

    not_ours(__name__, __file__)
