"""Write grants: a decode worker's proof that it reserved the blocks a prefill order names.

At the handshake the decode worker sends a fresh random key (over mutual TLS, only the two
peers see it). Each prefill order carries an HMAC-SHA256 under that key over the request id,
the decode worker's id, the blocks, the absolute deadline and start-by time and the order's
nonce, and over what decides the bytes written there: the prompt's tokens (a digest), the cache salt, the LoRA adapter and the multimodal
spans. It is minted where the blocks were reserved; the prefill worker checks it before
computing anything. An order with a wrong or missing grant (forged, or with any of those
altered: another tenant's salt, another adapter, a later deadline) writes nothing, and a
replayed order (a nonce the prefill worker has seen) is refused too.
"""
import dataclasses
import hashlib
import hmac
import json
import secrets

from pdserve.common.disagg import PrefillOrder

KEY_BYTES = 32
NONCE_BYTES = 16


def new_order_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def grant_of(key: bytes, order: PrefillOrder) -> bytes:
    """The HMAC over what the order asks for (its `grant` field itself excluded)."""
    request = order.request
    prompt = hashlib.sha256(b"".join(t.to_bytes(4, "little") for t in request.prompt_token_ids)).hexdigest()
    spans = [[s.content_hash.hex(), s.offset, s.length] for s in request.multimodal]
    signed = json.dumps([request.request_id, order.decode_worker_id, order.first_block,
                         list(order.dest_block_ids), float(order.deadline).hex(), float(order.start_by).hex(),
                         order.nonce.hex(), prompt, request.cache_salt,
                         request.lora_id, spans], separators=(",", ":"))
    return hmac.new(key, signed.encode(), hashlib.sha256).digest()


def granted(key: bytes, order: PrefillOrder) -> PrefillOrder:
    """`order` with its grant under `key`."""
    return dataclasses.replace(order, grant=grant_of(key, order))


def is_granted(key: bytes | None, order: PrefillOrder) -> bool:
    """True if `order` carries a grant under `key` (constant-time comparison)."""
    return key is not None and hmac.compare_digest(grant_of(key, order), order.grant)
