"""Everything Horovod, the only part of the package that imports it: :mod:`.support` (importing it, its
rules), :mod:`.process` (what both APIs' strategies share), the strategies of :mod:`.trainer` and
:mod:`.fabric` (with ``HorovodEnvironment``), ``adasum-horovodrun`` (:mod:`.horovodrun`) and its private APIs
(:mod:`._compat`). Importing this package imports neither Horovod nor Lightning; ``trainer`` and ``fabric``
have a copy for ``lightning`` each: ``adasum_lightning.lightning.horovod.*`` (adasum_lightning._namespaces).
"""
