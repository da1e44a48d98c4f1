"""Test and benchmark helpers that are not part of the product.

``tensorhub.testing.cluster``: an emulated multi-host Ray cluster on one machine (network
namespaces, rate-limited veth links, one raylet per emulated host). Nothing is imported here,
so importing this package has no side effects and needs neither root nor Ray.
"""
