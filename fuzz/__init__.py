if __name__ != "superfluid.fuzz":  # imported by its bare name from a checkout's root: not ours
    from superfluid.checkout import not_ours

    not_ours(__name__, __file__)
