"""Webhook signing secrets in the Standard Webhooks form (`whsec_` and base64): made by the
gateway and checked by both the gateway and the Python client, which shares only this layer.
"""

from __future__ import annotations

import base64
import binascii
import secrets

from subengine.model._errors import InvalidInput

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32


def new_secret() -> str:
    """A random signing secret in the Standard Webhooks form, whsec_<base64>."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def validate_secret(secret: object) -> str:
    """A signing secret: whsec_ and the base64 of 24 to 64 bytes. The message never
    quotes what was given."""
    if isinstance(secret, str) and secret.startswith(SECRET_PREFIX):
        try:
            raw = base64.b64decode(secret[len(SECRET_PREFIX) :], validate=True)
        except (binascii.Error, ValueError):
            raw = b""
        if 24 <= len(raw) <= 64:
            return secret
    raise InvalidInput(
        "invalid webhook secret (not shown): use 'whsec_' followed by the base64 of 24 to "
        "64 random bytes, or leave it out and one is made"
    )
