"""The reference server's side: everything that runs where a model's server runs.

- :mod:`~tensorhub.server.requests`: the request path every server shares (mailboxes, pulse
  holds, backlog, :func:`~tensorhub.server.requests.apply_request`).
- :mod:`~tensorhub.server.actor`: ``ReferenceServer``, the detached async Ray actor over
  :class:`~tensorhub.core.reference.ReferenceCore`.
- :mod:`~tensorhub.server.liveness`: what Ray knows about dead clients (sweeps, pushed deaths).
- :mod:`~tensorhub.server.naming`: the servers' actor names (pure);
  :mod:`~tensorhub.server.find`: find, create and list them in Ray.

The client's side of the conversation is :mod:`tensorhub.ports`. This package's ``__init__``
imports nothing, so a pure module (``naming``) is cheap to import alone.
"""
