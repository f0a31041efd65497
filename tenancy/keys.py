"""API key material: generation, peppered hashing and masking. Plaintext keys exist only in memory."""

from __future__ import annotations

import hashlib
import hmac
import secrets

KEY_PREFIX = "kvg-"
KEY_RANDOM_BYTES = 32  # 256 bits: brute force is hopeless, so a fast hash (not a KDF) is the right tool
DISPLAY_PREFIX_LEN = len(KEY_PREFIX) + 6


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(KEY_RANDOM_BYTES)


def hash_key(plaintext: str, pepper: bytes) -> str:
    """HMAC-SHA-256 keyed by a server-side pepper: a stolen DB file alone cannot confirm a guessed key."""
    if not pepper:
        raise ValueError("pepper must be a non-empty server secret")
    return hmac.new(pepper, plaintext.encode("utf-8"), hashlib.sha256).hexdigest()


def keys_match(stored_hash: str, candidate_hash: str) -> bool:
    return hmac.compare_digest(stored_hash.encode("ascii"), candidate_hash.encode("ascii"))


def display_prefix(plaintext: str) -> str:
    return plaintext[:DISPLAY_PREFIX_LEN]


def mask_key(plaintext: str) -> str:
    """`kvg-abcd...wxyz`: enough for a person to recognise their key, too little to use it."""
    if len(plaintext) <= 12:
        # Too short to be one of ours; echoing any of it would leak most of it.
        return "***"
    return f"{plaintext[:8]}...{plaintext[-4:]}"
