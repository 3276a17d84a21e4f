"""Tools run from the command line (``python -m ddo``, :mod:`.cli`): the machine check
(:mod:`.doctor`) and the side-by-side route benchmark (:mod:`.bench`)."""
