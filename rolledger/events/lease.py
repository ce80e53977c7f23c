"""Leader leases for coordinator roles, with fencing tokens.

One key per role (`lease_key(run, role)`) holds `<holder>#<token>` with a PX expiry; a counter (`fence_key`) hands out
the tokens with INCR, so every new tenure gets a larger token than any before it. A coordinator stamps its token on
every decision it appends (`fence` in the event payloads); a consumer or the audit then refuses a decision whose
token is older than one already seen, which stops a paused ex-leader that wakes up after its lease expired.

Acquire, renew and release are Lua scripts, so "is it still mine?" and the write happen atomically. A lease is
only as strong as the single Redis primary it lives on (no Redlock here).
"""

from __future__ import annotations

import redis

from rolledger.events.keys import fence_key, lease_key

# KEYS: lease, fence. ARGV: holder, ttl ms, our current value ('' if none).
# Returns -1 when our value is still there (renewed), the new token when acquired, nil when someone else holds it.
_ACQUIRE_LUA = """
local cur = redis.call('GET', KEYS[1])
if cur and ARGV[3] ~= '' and cur == ARGV[3] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return -1
end
if cur and string.match(cur, '^(.*)#%d+$') ~= ARGV[1] then return false end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. '#' .. token, 'PX', ARGV[2])
return token
"""

# KEYS: lease. ARGV: our value, ttl ms. 1 if renewed, 0 if the lease is no longer ours.
_RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# KEYS: lease. ARGV: our value. 1 if released, 0 if it was not ours any more.
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class LeaderLease:
    """The lease of one coordinator role for one holder (a process identity, e.g. `admission@host:pid`)."""

    def __init__(self, client: redis.Redis, run_id: str, role: str, holder: str, ttl_ms: int) -> None:
        if ttl_ms < 1:
            raise ValueError(f"ttl_ms must be >= 1, got {ttl_ms}")
        if not holder:
            raise ValueError("holder must be a non-empty name")
        self.client = client
        self.run_id = run_id
        self.role = role
        self.holder = holder
        self.ttl_ms = ttl_ms
        self.key = lease_key(run_id, role)
        self.fence = fence_key(run_id, role)
        self._token: int | None = None
        self._acquire = client.register_script(_ACQUIRE_LUA)
        self._renew = client.register_script(_RENEW_LUA)
        self._release = client.register_script(_RELEASE_LUA)

    @property
    def token(self) -> int | None:
        """The fencing token of the tenure this object holds (as far as it knows), None when not holding."""
        return self._token

    def _value(self) -> str:
        return f"{self.holder}#{self._token}" if self._token is not None else ""

    def acquire(self) -> int | None:
        """Take the lease if free (a new, larger token) or extend it if already ours (the same token).

        None when another holder has it. A lease left by an earlier incarnation of the same holder name (a restart
        that lost its token) is taken over with a new token, which fences the old incarnation out.
        """
        reply = self._acquire(keys=[self.key, self.fence], args=[self.holder, self.ttl_ms, self._value()])
        if reply is None:
            self._token = None
        elif int(reply) != -1:
            self._token = int(reply)
        return self._token

    def renew(self) -> bool:
        """Extend the lease by ttl_ms if it is still ours; False (and token None) if it expired or was taken."""
        if self._token is None:
            return False
        if int(self._renew(keys=[self.key], args=[self._value(), self.ttl_ms])) == 1:
            return True
        self._token = None
        return False

    def release(self) -> None:
        """Give the lease up if it is still ours (the token counter keeps growing; tokens are never reused)."""
        if self._token is not None:
            self._release(keys=[self.key], args=[self._value()])
        self._token = None

    def current_token(self) -> int:
        """The latest token ever handed out for this role (0 if none): a decision stamped lower is stale."""
        value = self.client.get(self.fence)
        return int(value) if value is not None else 0
