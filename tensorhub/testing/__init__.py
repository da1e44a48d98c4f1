"""Test and benchmark helpers that are not part of the product.

Product modules never import this package (a test scans the imports); the tests, the benchmarks,
the simulator and the ``demo``/``chaos``/``cluster`` commands may.

``tensorhub.testing.workload``: synthetic transformer-shaped weights, version fill, digests.
``tensorhub.testing.replica``: a ready-made replica actor that plays trainer or rollout.
The scenarios run on the emulated cluster (``crossdc``, ``stale_job``, ``foreign_job``) live
here too; the emulated cluster itself is a shipped tool, :mod:`tensorhub.emucluster`
(``tensorhub.testing.cluster`` re-exports it for one release). Nothing is imported here, so
importing this package has no side effects and needs neither root nor Ray.
"""
