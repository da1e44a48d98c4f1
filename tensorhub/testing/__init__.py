"""Test and benchmark helpers that are not part of the product.

Product modules never import this package (a test scans the imports); the tests, the benchmarks,
the simulator and the ``demo``/``chaos``/``cluster`` commands may.

``tensorhub.testing.workload``: synthetic transformer-shaped weights, version fill, digests.
``tensorhub.testing.replica``: a ready-made replica actor that plays trainer or rollout.
``tensorhub.testing.cluster``: an emulated multi-host Ray cluster on one machine (network
namespaces, rate-limited veth links, one raylet per emulated host). Nothing is imported here,
so importing this package has no side effects and needs neither root nor Ray.
"""
