"""Who is asking, and whether a write is theirs: the console's users file (scrypt hashes, HTTP
Basic), a trusted header set by an authenticating proxy, CSRF tokens, and the security headers
every response carries."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import getpass
import hashlib
import hmac
import ipaddress
import os
import re
import secrets
import threading
import time
from pathlib import Path

from relay.core import errors

#: scrypt's cost (n, r, p): about 50 ms and 16 MiB a check on one core.
_N, _R, _P = 2**14, 8, 1
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")


def hash_password(password: str) -> str:
    """A users-file entry's hash: `scrypt$n$r$p$salt$hash` (base64)."""
    if not password:
        raise errors.InvalidArgument("the password must not be empty")
    salt = secrets.token_bytes(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, n=_N, r=_R, p=_P, dklen=32)
    return "$".join(
        ["scrypt", str(_N), str(_R), str(_P), _b64(salt), _b64(digest)],
    )


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def check_password(stored: str, password: str) -> bool:
    try:
        kind, n, r, p, salt, digest = stored.split("$")
        if kind != "scrypt":
            return False
        want = base64.b64decode(digest, validate=True)
        got = hashlib.scrypt(
            password.encode(),
            salt=base64.b64decode(salt, validate=True),
            n=int(n),
            r=int(r),
            p=int(p),
            maxmem=256 * 1024 * 1024,
            dklen=len(want),
        )
    except (ValueError, binascii.Error):
        return False
    return hmac.compare_digest(got, want)


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise errors.InvalidArgument(
            f"not a user name: {name!r} (letters, digits and . _ @ -, at most 64)"
        )
    return name


def read_users(path: Path) -> dict[str, str]:
    """The users file: one `name:hash` a line (`outbox-relay console add-user` writes them);
    blank lines and lines starting with # are skipped. ConfigError if it cannot be used."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise errors.ConfigError(f"cannot read the users file {path}: {exc.strerror}") from None
    users: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, stored = line.partition(":")
        if not sep or not _NAME.fullmatch(name) or not stored.startswith("scrypt$"):
            raise errors.ConfigError(
                f"{path}:{number}: not `name:scrypt$…` (write it with "
                "`outbox-relay console add-user`)"
            )
        users[name] = stored
    if not users:
        raise errors.ConfigError(f"the users file {path} names no user")
    return users


def add_user(path: Path, name: str, password: str) -> bool:
    """Add `name` to the users file, or change its password; True if it was new. The file is
    created readable by its owner only."""
    check_name(name)
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    entry = f"{name}:{hash_password(password)}"
    kept = [line for line in lines if line.partition(":")[0].strip() != name]
    new = len(kept) == len(lines)
    path.touch(mode=0o600, exist_ok=True)
    path.write_text("\n".join([*kept, entry]) + "\n", encoding="utf-8")
    return new


#: A login checked once is trusted this long (each check is a scrypt: ~50 ms, 16 MiB), and at
#: most this many checks run at once (so that a flood of wrong passwords cannot exhaust memory).
REMEMBER_SECONDS = 300.0
CHECKS_AT_ONCE = 2
#: Checked for a name not in the file, so that a wrong name takes as long as a wrong password.
_NOBODY = hash_password("not a password of anyone")


def _os_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container's arbitrary user)
        return "uid-" + str(os.getuid())


@dataclasses.dataclass(frozen=True)
class Access:
    """How the console knows who is asking: nobody is asked on loopback without a users file
    or a trusted header (then `who` is the operating-system user that started it)."""

    users: dict[str, str] | None = None
    trusted_header: str | None = None
    local_user: str = dataclasses.field(default_factory=_os_user)
    _remembered: dict[bytes, tuple[str, float]] = dataclasses.field(
        default_factory=dict, compare=False, repr=False
    )
    _checks: threading.BoundedSemaphore = dataclasses.field(
        default_factory=lambda: threading.BoundedSemaphore(CHECKS_AT_ONCE),
        compare=False,
        repr=False,
    )

    @property
    def open(self) -> bool:
        return self.users is None and self.trusted_header is None

    def who(self, authorization: str | None, header_value: str | None) -> str | None:
        """The person asking, or None (401)."""
        if self.trusted_header is not None:
            if header_value and _NAME.fullmatch(header_value):
                return header_value
            return None
        if self.users is None:
            return f"{self.local_user}@localhost"
        name, password = _basic(authorization)
        if name is None or password is None:
            return None
        key = hashlib.sha256(f"{name}\0{password}".encode()).digest()
        known = self._remembered.get(key)
        if known is not None and known[1] > time.monotonic():
            return known[0]
        with self._checks:
            good = check_password(self.users.get(name, _NOBODY), password) and name in self.users
        if not good:
            return None
        if len(self._remembered) > 1000:
            self._remembered.clear()
        self._remembered[key] = (name, time.monotonic() + REMEMBER_SECONDS)
        return name


def _basic(authorization: str | None) -> tuple[str | None, str | None]:
    if not authorization or not authorization.lower().startswith("basic "):
        return None, None
    try:
        decoded = base64.b64decode(authorization[6:].strip(), validate=True).decode()
    except (ValueError, binascii.Error):
        return None, None
    name, sep, password = decoded.partition(":")
    return (name, password) if sep else (None, None)


def loopback(host: str) -> bool:
    """Whether `host` (what the console binds to) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Csrf:
    """A token per person, an HMAC under a secret of this process: a form carries it, and a
    write without the asker's token is refused (403). Another site cannot read it, so it cannot
    forge a write with the asker's credentials (which a browser sends by itself)."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret or secrets.token_bytes(32)

    def token(self, who: str) -> str:
        return hmac.new(self._secret, who.encode(), hashlib.sha256).hexdigest()

    def valid(self, who: str, token: str | None) -> bool:
        if token is None or not token.isascii():
            return False
        return hmac.compare_digest(self.token(who).encode(), token.encode())


#: Every response's security headers: no inline script or style, no framing, no sniffing.
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
