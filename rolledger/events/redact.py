"""Redis URLs without their secrets: `redact(url)` for every message, log line and file that names a URL.

`redis://user:secret@host:6379/0` becomes `redis://user:***@host:6379/0` (a password-only `redis://:secret@host`
becomes `redis://:***@host`); a `password=` query parameter is masked too. Anything that does not parse as a URL is
returned with every `:secret@` userinfo masked, so a malformed URL in an error message still hides its password.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "***"
_USERINFO = re.compile(r"(//[^/@:]*):[^@/]*@")


def redact(url: str) -> str:
    """The URL with its password (userinfo or `password=` query parameter) replaced by ***."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return _USERINFO.sub(rf"\1:{MASK}@", url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, sep, _password = userinfo.partition(":")
        if sep:  # `user@host` carries no password: left as it is
            netloc = f"{user}:{MASK}@{hostport}"
    query = parts.query
    if query and "password" in query.lower():
        query = urlencode(
            [(k, MASK if k.lower() == "password" else v) for k, v in parse_qsl(query, keep_blank_values=True)],
            safe="*",
        )
    if "://" not in url:
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    tail = (f"?{query}" if query else "") + (f"#{parts.fragment}" if parts.fragment else "")
    return f"{parts.scheme}://{netloc}{parts.path}{tail}"


def password_of(url: str) -> str | None:
    """The password a URL carries (userinfo or `password=` query parameter), None without one."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    if parts.password:
        return parts.password
    for k, v in parse_qsl(parts.query):
        if k.lower() == "password":
            return v
    return None


def with_password(url: str, password: str) -> str:
    """A redacted URL with its *** replaced by `password` again (the password taken from the environment)."""
    from urllib.parse import quote

    return url.replace(f":{MASK}@", f":{quote(password, safe='')}@", 1).replace(
        f"password={MASK}", f"password={quote(password, safe='')}", 1
    )
