"""Write grants: a decode worker's proof that it reserved the blocks a prefill order names.

At the handshake the decode worker sends a fresh random key (over mutual TLS, only the two
peers see it). Each prefill order carries an HMAC-SHA256 under that key over the request id,
the decode worker's id, the blocks and the deadline, minted where the blocks were reserved; the
prefill worker checks it before computing anything. An order with a wrong or missing grant —
forged, or with its blocks or deadline altered — writes nothing.
"""
import dataclasses
import hashlib
import hmac
import json
import secrets

from pdserve.common.disagg import PrefillOrder

KEY_BYTES = 32


def new_order_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def grant_of(key: bytes, order: PrefillOrder) -> bytes:
    """The HMAC over what the order asks for (its `grant` field itself excluded)."""
    signed = json.dumps([order.request.request_id, order.decode_worker_id, order.first_block,
                         list(order.dest_block_ids), float(order.timeout_s).hex()], separators=(",", ":"))
    return hmac.new(key, signed.encode(), hashlib.sha256).digest()


def granted(key: bytes, order: PrefillOrder) -> PrefillOrder:
    """`order` with its grant under `key`."""
    return dataclasses.replace(order, grant=grant_of(key, order))


def is_granted(key: bytes | None, order: PrefillOrder) -> bool:
    """True if `order` carries a grant under `key` (constant-time comparison)."""
    return key is not None and hmac.compare_digest(grant_of(key, order), order.grant)
