"""Everything Horovod, and the only part of the package that imports it.

- :mod:`.support`: importing Horovod, the build command when it is missing, and the rules of its launch,
  Adasum and optimizer;
- :mod:`.process`: what a Horovod strategy of either API does the same way (``HorovodProcess``);
- :mod:`.trainer` and :mod:`.fabric`: the ``horovod_adasum`` and ``horovod`` strategies of the Trainer and of
  Fabric, and ``HorovodEnvironment``; importing one registers its strategies;
- :mod:`.horovodrun`: ``adasum-horovodrun``;
- :mod:`._compat`: the private Horovod APIs used.

Importing this package imports neither Horovod nor Lightning. ``trainer`` and ``fabric`` exist once per
Lightning package, as the other strategies do (:mod:`adasum_lightning._namespaces`): the copies for
``lightning`` are ``adasum_lightning.lightning.horovod.trainer`` and ``.fabric``.
"""
