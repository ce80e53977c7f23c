"""The Lua scripts of the run log's appends (events/store.py runs them): every append script's common part (the
dedupe hash, the run's end marker, the routing of each event type to its work stream, the append mark's status), the
plain, batched, conditional and once-only appends, and the dead-letter copy. One script call per append is what keeps
Redis near half a command per event.
"""

from __future__ import annotations

from rolledger.events.entries import FINISHED_FIELD
from rolledger.events.work import BATCHED, GROUPS, ROUTES

# KEYS: dead-letter stream, seen hash. ARGV: once-field ('' = no dedupe), then field/value pairs for XADD.
DEAD_LETTER_LUA = """
if ARGV[1] ~= '' then
  local existing = redis.call('HGET', KEYS[2], ARGV[1])
  if existing then return existing end
end
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
if ARGV[1] ~= '' then redis.call('HSET', KEYS[2], ARGV[1], id) end
return id
"""

# Every append script: KEYS = log, dedupe hash, then the work stream of each group of events.work.GROUPS. An event id
# already in the dedupe hash is not written again (its original stream id comes back); the append of a RunFinished
# sets the marker (FINISHED_FIELD of the dedupe hash, read by the same HMGET as the batch's ids) in the same call; a
# batch with any event not yet recorded is refused while the marker is set ({-1, marker}). The call's new events are one entry (see the module docstring).
# An event whose type events.work.ROUTES names is also added to that group's work stream (e = bytes, t = type, s = its
# log stream id, k = its place in a log entry of several; for a group of events.work.BATCHED, the events of the call
# as one entry: b, t, s and k, as in the log) in the same call, so it is there exactly once.
# The dedupe hash costs two commands per call, not two per event: one HMGET of the batch's ids, one HSET of the new.
ROUTE_TABLE_LUA = (
    "local route = {" + ", ".join(f"[{t!r}] = {3 + GROUPS.index(g)}" for t, g in sorted(ROUTES.items())) + "}\n"
    "local batched = {" + ", ".join(f"[{3 + GROUPS.index(g)}] = true" for g in sorted(BATCHED)) + "}\n"
    f"local FINISHED = {FINISHED_FIELD!r}\n"
)
APPEND_COMMON_LUA = (
    ROUTE_TABLE_LUA
    + """
local CHUNK = 1000  -- arguments per unpack (Lua's C stack bounds it)
local function be(n, bytes)  -- n big-endian in `bytes` bytes
  local out = {}
  for i = bytes, 1, -1 do out[i] = string.char(n % 256); n = math.floor(n / 256) end
  return table.concat(out)
end
local function bin(s)  -- a msgpack bin holding s
  local len = #s
  if len < 256 then return string.char(196) .. be(len, 1) .. s end
  if len < 65536 then return string.char(197) .. be(len, 2) .. s end
  return string.char(198) .. be(len, 4) .. s
end
local pairs_of = pairs  -- (the name `pairs` is a local list below)
local function array_of(n)  -- a msgpack array header of n items
  if n < 16 then return string.char(144 + n) end
  if n < 65536 then return string.char(220) .. be(n, 2) end
  return string.char(221) .. be(n, 4)
end
local function recorded(n, first)  -- each event's stream id if recorded (else false), how many are not, the marker
  local ids = {}
  local fresh = 0
  local closed = false
  for lo = 1, n, CHUNK do
    local hi = math.min(n, lo + CHUNK - 1)
    local fields = {}
    for i = lo, hi do fields[#fields + 1] = ARGV[first + 3 * (i - 1)] end
    if lo == 1 then fields[#fields + 1] = FINISHED end  -- the run's end, in the same HMGET
    local got = redis.call('HMGET', KEYS[2], unpack(fields))
    for i = lo, hi do
      local existing = got[i - lo + 1]
      if existing then ids[i] = existing else ids[i] = false; fresh = fresh + 1 end
    end
    if lo == 1 then closed = got[#fields] end
  end
  return ids, fresh, closed
end
local function remember(pairs)
  for lo = 1, #pairs, 2 * CHUNK do
    redis.call('HSET', KEYS[2], unpack(pairs, lo, math.min(#pairs, lo + 2 * CHUNK - 1)))
  end
end
local function batch_of(js)  -- the events at ARGV[j + 1] (bytes), ARGV[j + 2] (type): a msgpack array, the types
  local parts, types = {array_of(#js)}, {}
  for i, j in ipairs(js) do
    parts[i + 1] = bin(ARGV[j + 1])
    types[i] = ARGV[j + 2]
  end
  return table.concat(parts), table.concat(types, ',')
end
local function write(n, first, ids)
  local status = 2  -- 1: the call's first event is in the new entry (so is the append mark it carries)
  if not ids[1] then status = 1 end
  local fresh = {}
  for i = 1, n do
    if not ids[i] then fresh[#fresh + 1] = first + 3 * (i - 1) end
  end
  local id
  if #fresh == 1 then
    id = redis.call('XADD', KEYS[1], '*', 'e', ARGV[fresh[1] + 1], 't', ARGV[fresh[1] + 2])
  elseif #fresh > 1 then  -- one entry for the batch
    local b, t = batch_of(fresh)
    id = redis.call('XADD', KEYS[1], '*', 'b', b, 't', t)
  end
  local pairs, held, finishing = {}, {}, false
  for k, j in ipairs(fresh) do
    pairs[#pairs + 1] = ARGV[j]
    pairs[#pairs + 1] = id
    local work = route[ARGV[j + 2]]
    if work and #fresh == 1 then
      redis.call('XADD', KEYS[work], '*', 'e', ARGV[j + 1], 't', ARGV[j + 2], 's', id)
    elseif work and batched[work] then  -- one work entry per append, written below
      held[work] = held[work] or {js = {}, places = {}}
      table.insert(held[work].js, j)
      table.insert(held[work].places, k - 1)
    elseif work then  -- k: its place in the log entry, 0-based
      redis.call('XADD', KEYS[work], '*', 'e', ARGV[j + 1], 't', ARGV[j + 2], 's', id, 'k', k - 1)
    end
    if ARGV[j + 2] == 'RunFinished' and not finishing then  -- the marker (not set: the call would be refused)
      finishing = true
      pairs[#pairs + 1] = FINISHED
      pairs[#pairs + 1] = id
    end
  end
  for work, h in pairs_of(held) do
    local b, t = batch_of(h.js)
    redis.call('XADD', KEYS[work], '*', 'b', b, 't', t, 's', id, 'k', table.concat(h.places, ','))
  end
  for i = 1, n do
    if not ids[i] then ids[i] = id end
  end
  remember(pairs)
  table.insert(ids, 1, status)
  return ids
end
"""
)

# Replies of every append script: {status, stream id of each event...} where status 1 says the call wrote a new entry
# and its first event is in it (with the writer's append mark, see EventLog), 2 that the first event was recorded
# before (a retry; every event recorded before wrote nothing); {0, ...} and {-1, marker} as each script says.
# ARGV: (event id, bytes, type) triples. Returns {1 or 2, id...}, or {-1, marker} after the run's end.
APPEND_MANY_LUA = (
    APPEND_COMMON_LUA
    + """
local n = #ARGV / 3
local ids, fresh, closed = recorded(n, 1)
if fresh > 0 and closed then return {-1, closed} end
return write(n, 1, ids)
"""
)

# ARGV: expected last id ('' = empty stream), then (event id, bytes, type) triples.
# Returns {1 or 2, id...} on success, {0, actual last id or ''} on conflict, {-1, marker} after the run's end.
# A batch whose every event id is already recorded is a retry of a call that succeeded: its original ids come back
# without a version check. Otherwise the check applies, and recorded events keep their original ids.
APPEND_IF_LUA = (
    APPEND_COMMON_LUA
    + """
local n = (#ARGV - 1) / 3
local ids, fresh, closed = recorded(n, 2)
if fresh == 0 then
  table.insert(ids, 1, 2)
  return ids
end
if closed then return {-1, closed} end
local top = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local last = ''
if #top > 0 then last = top[1][1] end
if last ~= ARGV[1] then return {0, last} end
return write(n, 2, ids)
"""
)

# Numbered once-keys whose numbers only grow (a step, a staged version: workflows/trainer.TrainPlan.once_keys): the
# archiver prunes their fields behind its trim and raises the sequence's floor first (the field FLOOR_PREFIX +
# "once:" + the prefix, events/archiver.py), so a key numbered at or below the floor counts as taken however old it is.
ONCE_SEQUENCES = ("step:", "UpdateStaged:v")
FLOOR_PREFIX = "floor:"
_FLOORS_LUA = ", ".join(f"'{FLOOR_PREFIX}once:{p}'" for p in ONCE_SEQUENCES)
_SEQUENCES_LUA = ", ".join(f"'once:{p}'" for p in ONCE_SEQUENCES)

# ARGV: k, then k once-keys, then (event id, bytes, type) triples. Returns {1 or 2, id...} when the batch was appended (and
# every key recorded) or when every event of it was recorded before (a retry of a call that succeeded: the original
# ids), {0, the first key already taken} when any key was taken before (or is numbered at or below its sequence's
# floor), {-1, marker} after the run's end.
APPEND_ONCE_LUA = (
    APPEND_COMMON_LUA
    + """
local k = tonumber(ARGV[1])
local n = (#ARGV - 1 - k) / 3
local ids, fresh, closed = recorded(n, k + 2)
if fresh == 0 then
  table.insert(ids, 1, 2)
  return ids
end
for lo = 2, k + 1, CHUNK do  -- one HMGET of the keys (a step's keys name every group it consumes)
  local hi = math.min(k + 1, lo + CHUNK - 1)
  local taken = redis.call('HMGET', KEYS[2], unpack(ARGV, lo, hi))
  for i = lo, hi do
    if taken[i - lo + 1] then return {0, ARGV[i]} end
  end
end
local floors = redis.call('HMGET', KEYS[2], """
    + _FLOORS_LUA
    + """)
local sequences = {"""
    + _SEQUENCES_LUA
    + """}
for j = 1, #sequences do
  if floors[j] then
    local p, floor = sequences[j], tonumber(floors[j])
    for i = 2, k + 1 do
      if string.sub(ARGV[i], 1, #p) == p then
        local num = tonumber(string.sub(ARGV[i], #p + 1))
        if num and num <= floor then return {0, ARGV[i]} end
      end
    end
  end
end
if closed then return {-1, closed} end
ids = write(n, k + 2, ids)
local claimed = {}
for i = 2, k + 1 do
  claimed[#claimed + 1] = ARGV[i]
  claimed[#claimed + 1] = ids[2]
end
remember(claimed)
return ids
"""
)

# KEYS: the dedupe hash. ARGV: a floor field, a number. Raises the field to the number (never lowers it).
RAISE_FLOOR_LUA = """
local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '-1')
if tonumber(ARGV[2]) > cur then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
return cur
"""
