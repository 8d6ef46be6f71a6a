"""Deployment on Flower's Deployment Engine: federation credentials (:mod:`.credentials`: the coordinator's
CA and SuperLink certificate, each data owner's own keys), the data owner's code pin (:mod:`.pin`) and the
exact Flower 1.42 commands of the coordinator and the data owners (:mod:`.commands`), behind
``distmoe credentials`` and ``distmoe deploy``. Flower does the transport; this package only makes
the files it needs and spells out its command lines.
"""
