"""Who may send what to a reference server: capabilities, the model secret, the bounds.

Ray's token authentication admits processes to the cluster; it is one token for every job of
the cluster. The reference server adds, in front of its table (docs/security.md):

- **A capability per client.** A handle draws 32 random bytes (:mod:`secrets`) when it is
  built and its port presents them with every request (:class:`~tensorhub.core.messages.Signed`).
  The server binds a client id to the capability it first registers with (``Register``, or the
  ``Announce`` to a restarted server: a fresh server binds it anew) and from then on refuses
  every request that acts for that id without it: ``Unauthorized``, nothing changed. A request
  acts for its ``client_id``, a ``Register``'s ``stage_for`` and a ``Swap``'s ``stage_id`` (the
  handle's own staging copy, which must be registered) and every beat of a ``Pulse``; the notes
  poll too. Because the client chooses it, a retried registration whose reply was lost, and the
  re-announcements a handle's two threads may race after a restart, carry the same one: the
  server never has to hand a secret out. An id the table no longer holds (left, expired,
  declared dead) is free: its next registration binds it again -- unless a staging copy
  registered for it (``stage_for``, re-announced before its owner after a restart) bound it to
  the owner's capability it carried: then the owner must bring that one.
- **An optional model secret** (``Config.model_secret``). A server created with one refuses a
  ``Register``/``Announce`` that does not carry ``HMAC(secret, client id | capability)``
  (:func:`register_proof`), and proves the secret back in ``Registered.proof``
  (:func:`server_proof`), which the client checks: a server that another job created under the
  model's name without the secret is refused by the client (``Unauthorized``). The secret itself
  never crosses the wire and is never logged.
- **Bounds** (:mod:`tensorhub.core.bounds`) and **one model per server**: checked before the
  table sees the request.
- **A reader's view**: ``Query`` answers the model's shards, versions and layouts, not its
  holders. The operator view with every holder (:meth:`Gate.operator_view`) needs the model
  secret's proof where the server has one.

Capabilities are compared in constant time (:func:`hmac.compare_digest`). :class:`Gate` is the
server's side, shared by the Ray actor, :class:`tensorhub.ports.LocalPort` and the simulated
server; :class:`Keyring` is the client's (one per server a process talks to, shared by its
ports so that one pulse can carry every handle's capability).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from typing import Callable, Hashable, Optional, Union

import msgspec

from tensorhub.core import bounds
from tensorhub.core import messages as m
from tensorhub.errors import TensorHubError, Unauthorized, code_of

CAP_BYTES = 32
"""Length of a capability."""


def _mac(secret: str, *parts: Union[str, bytes]) -> bytes:
    msg = b"\0".join(p.encode() if isinstance(p, str) else p for p in parts)
    return hmac.new(secret.encode(), msg, hashlib.sha256).digest()


def register_proof(model_secret: str, client_id: str, cap: bytes) -> bytes:
    """What a client sends to show it holds the model secret (bound to its id and capability)."""
    return _mac(model_secret, "tensorhub register", client_id, cap)


def server_proof(model_secret: str, client_id: str, cap: bytes) -> bytes:
    """What a server answers to show it holds the model secret too."""
    return _mac(model_secret, "tensorhub server", client_id, cap)


def operator_proof(model_secret: str, model: str) -> bytes:
    """What ``tensorhub status`` sends for the operator view of a server with a model secret."""
    return _mac(model_secret, "tensorhub status", model)


def acts_for(req: m.Request) -> tuple[str, ...]:
    """The client ids a request acts for (their capabilities must come with it)."""
    match req:
        case m.Register():
            return (req.client_id, req.stage_for) if req.stage_for else (req.client_id,)
        case m.Announce():
            return acts_for(req.register)
        case m.Pulse():
            return tuple(b.client_id for b in req.beats)
        case m.Swap():
            return (req.client_id, req.stage_id)
        case m.Query():
            return ()
        case _:
            return (req.client_id,)


def _known_layout(core, req: m.Request) -> Optional[m.LayoutInfo]:
    reg = req if isinstance(req, m.Register) else req.register if isinstance(req, m.Announce) else None
    if reg is None:
        return None
    mod = core.models.get(reg.model)
    return None if mod is None else mod.layouts.get(reg.shard)


def unwrap(envelope: Union[m.Request, m.Signed]) -> tuple[m.Request, dict[str, bytes], bytes]:
    """(request, capabilities, model proof) of a request, bare (none) or signed."""
    if isinstance(envelope, m.Signed):
        return envelope.request, envelope.caps, envelope.model_proof
    return envelope, {}, b""


def _refusal(err: TensorHubError) -> m.ErrorReply:
    return m.ErrorReply(code=code_of(err), message=str(err))


class Gate:
    """The server's check of every request (see the module docstring). Pure but for the
    comparison: no clock, no randomness. ``served``: the model the server serves ("" : every
    model). The table it guards is passed to each call (a restarted server gets a new Gate)."""

    def __init__(self, model_secret: str = "", served: str = "") -> None:
        self._secret = model_secret
        self.served = served
        self._caps: dict[str, bytes] = {}
        """client id -> the capability it registered with (live clients; pruned lazily)."""
        self._staged: dict[str, tuple[bytes, str]] = {}
        """A free client id a staging copy registered for (``stage_for``, e.g. re-announced
        after a restart before its owner) -> (the owner's capability it carried, the stage's
        id): the owner's own registration must carry the same."""
        self.refused = 0
        """Requests refused as Unauthorized so far."""

    def __repr__(self) -> str:
        return f"Gate(served={self.served!r}, clients={len(self._caps)}, model_secret={'set' if self._secret else 'none'})"

    # ------------------------------------------------------------------ requests

    def admit(self, core, envelope: Union[m.Request, m.Signed]) -> tuple[m.Request, Optional[m.ErrorReply]]:
        """The bare request of ``envelope`` and, if it must be refused, the reply to send
        instead (``Unauthorized``, ``OutOfBounds``, ``WrongModel``); then nothing may be
        done with it. ``core``: the table (``nodes``, ``models``)."""
        req, caps, proof = unwrap(envelope)
        try:
            bounds.check_request(req, self.served, core.models, _known_layout(core, req))
            self._check(core, req, caps, proof)
        except TensorHubError as err:
            if isinstance(err, Unauthorized):
                self.refused += 1
            return req, _refusal(err)
        return req, None

    def _check(self, core, req: m.Request, caps: dict[str, bytes], proof: bytes) -> None:
        reg = req if isinstance(req, m.Register) else req.register if isinstance(req, m.Announce) else None
        if reg is not None:
            cap = caps.get(reg.client_id, b"")
            if len(cap) != CAP_BYTES:
                raise Unauthorized(f"client {reg.client_id}: a registration needs its {CAP_BYTES}-byte capability")
            if self._secret and not hmac.compare_digest(proof, register_proof(self._secret, reg.client_id, cap)):
                raise Unauthorized(f"model {reg.model}: its server requires the model secret "
                                   "(Config.model_secret / TENSORHUB_MODEL_SECRET), and this registration "
                                   "does not prove it")
        for cid in acts_for(req):
            node = core.nodes.get(cid)
            if node is not None and not node.host:
                known = self._caps.get(cid)
            elif reg is not None:
                # A free id: this registration binds it -- unless a staging copy registered for
                # it already bound it (its owner, of the same process, comes with the same one).
                known = self._staged.get(cid, (None,))[0]
                if known is None and len(caps.get(cid, b"")) == CAP_BYTES:
                    continue
            else:
                continue  # not registered: the table answers UnknownClient
            if known is None or not hmac.compare_digest(known, caps.get(cid, b"")):
                raise Unauthorized(f"{type(req).__name__} acts for client {cid} without its capability")

    def answered(self, core, envelope: Union[m.Request, m.Signed], reply: object) -> object:
        """After the table answered an admitted request with ``reply``: bind a registered id
        to its capability, forget a client that left, keep a reader's ``Query`` to what a
        reader needs. Returns the reply to send."""
        req, caps, _ = unwrap(envelope)
        match req:
            case m.Register() | m.Announce():
                reg = req if isinstance(req, m.Register) else req.register
                node = core.nodes.get(reg.client_id)
                if node is not None and not node.host:
                    # Bound whatever the reply: a registration the table answered with an error
                    # may still have put the node in (an Announce whose unconfirmed completion
                    # is refused stays as an idle node); unbound, every later request of the
                    # client would be refused until its lease ran out. admit() already checked
                    # that an id bound before comes with the same capability.
                    self._bind(core, reg.client_id, caps[reg.client_id])
                    owner = core.nodes.get(reg.stage_for) if reg.stage_for else None
                    if reg.stage_for and (owner is None or owner.host):
                        self._staged[reg.stage_for] = (caps[reg.stage_for], reg.client_id)
                if isinstance(reply, m.Registered) and self._secret:
                    proof = server_proof(self._secret, reg.client_id, caps[reg.client_id])
                    return m.Registered(round_seq=reply.round_seq, proof=proof)
            case m.Leave() if isinstance(reply, m.Ok):
                self._caps.pop(req.client_id, None)
            case m.Query() if isinstance(reply, m.Status):
                # everything but the holders (client ids), whatever fields a view grows
                return m.Status(models=tuple(msgspec.structs.replace(v, holders=()) for v in reply.models))
        return reply

    def _bind(self, core, cid: str, cap: bytes) -> None:
        self._caps[cid] = cap
        self._staged.pop(cid, None)
        if len(self._caps) + len(self._staged) > 2 * len(core.nodes) + 1024:
            # amortised: ids the table dropped, stage claims whose stage is gone
            for old in [c for c in self._caps if c not in core.nodes]:
                del self._caps[old]
            for owner in [o for o, (_, stage) in self._staged.items() if stage not in core.nodes]:
                del self._staged[owner]

    # ------------------------------------------------------------------ other entry points

    def check_notes(self, core, client_id: str, cap: bytes) -> None:
        """The notes poll of ``client_id`` (it pops the client's background events): raises
        Unauthorized unless it carries the client's capability (an unknown id has none)."""
        node = core.nodes.get(client_id)
        if node is None or node.host:
            return
        known = self._caps.get(client_id)
        if known is None or not hmac.compare_digest(known, cap):
            self.refused += 1
            raise Unauthorized(f"notes of client {client_id} without its capability")

    def operator_view(self, core, model: str, proof: bytes) -> object:
        """The whole table of ``model`` ("" : every model served) for an operator (``tensorhub
        status``): a ``Status``, or an ``ErrorReply`` (Unauthorized) on a server with a model
        secret when ``proof`` is not :func:`operator_proof` of it."""
        if self._secret and not hmac.compare_digest(proof, operator_proof(self._secret, model)):
            self.refused += 1
            return _refusal(Unauthorized("this server's operator view needs the model secret "
                                         "(TENSORHUB_MODEL_SECRET)"))
        return core.status(model)


TokenSource = Callable[[str], bytes]
"""Draws the capability of a client id (production: :func:`secrets.token_bytes`)."""


def _random_token(_client_id: str) -> bytes:
    return secrets.token_bytes(CAP_BYTES)


class Keyring:
    """The client side: the capability of every handle of this process on one server, drawn at
    the handle's first registration, attached to each of its requests (:meth:`sign`), dropped
    when it has left. Thread-safe. ``token``: where capabilities come from (the simulator draws
    them deterministically)."""

    def __init__(self, token: TokenSource = _random_token) -> None:
        self._token = token
        self._caps: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Keyring(<{len(self._caps)} capabilities>)"

    def cap(self, client_id: str) -> bytes:
        """This process's capability for ``client_id`` (b"" if it never registered it)."""
        return self._caps.get(client_id, b"")

    def sign(self, request: Union[m.Request, m.Signed], model_secret: str = "") -> m.Signed:
        """``request`` with the capabilities of the clients it acts for; a registration draws
        one for a new client id, and proves ``model_secret`` if there is one. A request that is
        already :class:`Signed` goes as it is."""
        if isinstance(request, m.Signed):
            return request
        reg = request if isinstance(request, m.Register) else getattr(request, "register", None)
        with self._lock:
            if reg is not None and reg.client_id not in self._caps:
                self._caps[reg.client_id] = self._token(reg.client_id)
            caps = {cid: self._caps[cid] for cid in acts_for(request) if cid in self._caps}
        proof = b""
        if reg is not None and model_secret:
            proof = register_proof(model_secret, reg.client_id, caps[reg.client_id])
        return m.Signed(request=request, caps=caps, model_proof=proof)

    def answered(self, request: Union[m.Request, m.Signed], reply: object, model_secret: str = "") -> None:
        """See the server's reply to ``request``: a ``Registered`` from a server that cannot
        prove ``model_secret`` raises Unauthorized; a client that left is forgotten."""
        req = request.request if isinstance(request, m.Signed) else request
        if isinstance(req, m.Register) and isinstance(reply, m.Registered) and model_secret:
            want = server_proof(model_secret, req.client_id, self.cap(req.client_id))
            if not hmac.compare_digest(reply.proof, want):
                raise Unauthorized(f"model {req.model}: its server does not hold this model secret (another "
                                   "job may have created a server under the model's name); not registered")
        if isinstance(req, m.Leave) and isinstance(reply, m.Ok):
            with self._lock:
                self._caps.pop(req.client_id, None)


_keyrings: dict[Hashable, Keyring] = {}
_keyrings_lock = threading.Lock()


def keyring_for(key: Hashable) -> Keyring:
    """The process's keyring for the server ``key`` names (a port's ``pulse_key()``): every
    port to that server shares it, as its handles share one pulse."""
    with _keyrings_lock:
        ring = _keyrings.get(key)
        if ring is None:
            ring = _keyrings[key] = Keyring()
        return ring
