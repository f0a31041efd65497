"""The Redis backend's half of `tenancy.limits_spec`: the admit and settle steps as Lua scripts, each run atomically
by Redis (it checks every scope and only then consumes in all of them). Each block is named after the function of
the specification it implements; the constants come from there too.

Time is the caller's clock, passed in ARGV (never Redis TIME), so gateways on synced hosts agree and tests drive a
fake clock. Quotas come from the caller on every call. Key layout: see `tenancy.redis_limiter`.
"""

from __future__ import annotations

from tenancy.limits_spec import EPS, WINDOW_S

_COMMON = f"""
local WINDOW = {WINDOW_S!r}
local EPS = {EPS!r}
local function num(s) if s == '' then return nil end return tonumber(s) end
local function fmt(x) return string.format('%.17g', x) end
local function refill(level, updated, cap, now)  -- limits_spec.refill
  if level == nil then return cap end  -- a missing bucket is a full one
  return math.min(cap, level + math.max(0, now - updated) * cap / WINDOW)
end
local function wait_for(need, level, cap)  -- limits_spec.wait_for
  return math.max(0, (need - level) * WINDOW / cap)
end
local function keep_for(key, ttl)  -- extend a key's expiry, never shorten it
  if redis.call('TTL', key) < ttl then redis.call('EXPIRE', key, ttl) end
end
"""

# KEYS: per scope i: bucket (3i-2), budget (3i-1), inflight (3i).
# ARGV: now, cost, request_id, lease_s, idle_margin_s, n, then per scope 6 values ('' = unlimited / none):
#   rpm, tpm, max_concurrent, token_budget, budget_ttl_s, seed.
# Returns {'seed', i...} (budget counters missing and not seeded: ask the ledger and call again), or
# {'budget', i, levels...}, {'rate', requests_wait, tokens_wait, levels...}, {'concurrency', i, count, levels...},
# {'ok', levels...}; levels are 2 strings per scope (requests, tokens; '' where unlimited), waits '' where not short.
ADMIT = _COMMON + """
local now = tonumber(ARGV[1])
local cost = tonumber(ARGV[2])
local rid = ARGV[3]
local lease = tonumber(ARGV[4])
local margin = tonumber(ARGV[5])
local n = tonumber(ARGV[6])
local q = {}
local missing = {}
-- step 2, budget_transition: a counter is keyed by its period's end, so a missing one is a first sight (seed it)
for i = 1, n do
  local b = 6 + (i - 1) * 6
  local s = {rpm = num(ARGV[b + 1]), tpm = num(ARGV[b + 2]), maxc = num(ARGV[b + 3]), budget = num(ARGV[b + 4]),
             budget_ttl = ARGV[b + 5], seed = ARGV[b + 6]}
  q[i] = s
  if s.budget then
    local used = redis.call('GET', KEYS[3 * i - 1])
    if used then
      s.used = tonumber(used)
    elseif s.seed ~= '' then
      redis.call('SET', KEYS[3 * i - 1], s.seed, 'NX', 'EX', s.budget_ttl)
      s.used = tonumber(redis.call('GET', KEYS[3 * i - 1]))
    else
      missing[#missing + 1] = i
    end
  end
end
if #missing > 0 then
  return {'seed', unpack(missing)}
end
for i = 1, n do
  local s = q[i]
  local h = redis.call('HMGET', KEYS[3 * i - 2], 'rl', 'ru', 'tl', 'tu')
  if s.rpm then s.rl = refill(tonumber(h[1]), tonumber(h[2]), s.rpm, now) end
  if s.tpm then s.tl = refill(tonumber(h[3]), tonumber(h[4]), s.tpm, now) end
  redis.call('ZREMRANGEBYSCORE', KEYS[3 * i], '-inf', ARGV[1])  -- expired leases (Redis only)
  s.count = redis.call('ZCARD', KEYS[3 * i])
end
local function with_levels(out)  -- step 5: the caller builds rate_limit_info from these
  for i = 1, n do
    out[#out + 1] = q[i].rl and fmt(q[i].rl) or ''
    out[#out + 1] = q[i].tl and fmt(q[i].tl) or ''
  end
  return out
end
-- step 3, check
local req_wait, tok_wait, conc = nil, nil, nil
for i = 1, n do
  local s = q[i]
  if s.budget and s.used + cost > s.budget then
    return with_levels({'budget', i})
  end
  if s.rpm and s.rl + EPS < 1 then req_wait = math.max(req_wait or 0, wait_for(1, s.rl, s.rpm)) end
  if s.tpm and s.tl + EPS < cost then tok_wait = math.max(tok_wait or 0, wait_for(cost, s.tl, s.tpm)) end
  if s.maxc and s.count >= s.maxc then conc = i end
end
if req_wait or tok_wait then
  return with_levels({'rate', req_wait and fmt(req_wait) or '', tok_wait and fmt(tok_wait) or ''})
end
if conc then
  return with_levels({'concurrency', conc, q[conc].count})
end
-- step 4: consume in every scope
for i = 1, n do
  local s = q[i]
  local fields = {}
  local full_in = 0
  if s.rpm then
    s.rl = s.rl - 1
    fields[#fields + 1] = 'rl'; fields[#fields + 1] = fmt(s.rl)
    fields[#fields + 1] = 'ru'; fields[#fields + 1] = ARGV[1]
    full_in = math.max(full_in, wait_for(s.rpm, s.rl, s.rpm))
  end
  if s.tpm then
    s.tl = s.tl - cost
    fields[#fields + 1] = 'tl'; fields[#fields + 1] = fmt(s.tl)
    fields[#fields + 1] = 'tu'; fields[#fields + 1] = ARGV[1]
    full_in = math.max(full_in, wait_for(s.tpm, s.tl, s.tpm))
  end
  if #fields > 0 then
    redis.call('HSET', KEYS[3 * i - 2], unpack(fields))
    keep_for(KEYS[3 * i - 2], math.ceil(full_in) + margin)
  end
  if s.budget then redis.call('INCRBY', KEYS[3 * i - 1], cost) end
  redis.call('ZADD', KEYS[3 * i], fmt(now + lease), rid)
  keep_for(KEYS[3 * i], math.ceil(lease) + margin)
end
return with_levels({'ok'})
"""

# KEYS: per scope i: bucket (3i-2), budget (3i-1), inflight (3i).
# ARGV: now, delta (reserved - used), request_id, idle_margin_s, n, then per scope: tpm ('' = none),
#   refund_budget ('1' when the reservation's budget period is still the current one).
SETTLE = _COMMON + """
local now = tonumber(ARGV[1])
local delta = tonumber(ARGV[2])
local margin = tonumber(ARGV[4])
local n = tonumber(ARGV[5])
for i = 1, n do
  local tpm = num(ARGV[5 + 2 * i - 1])
  if tpm then  -- step 6, settled_tokens
    local h = redis.call('HMGET', KEYS[3 * i - 2], 'tl', 'tu')
    local tl = math.min(tpm, refill(tonumber(h[1]), tonumber(h[2]), tpm, now) + delta)
    redis.call('HSET', KEYS[3 * i - 2], 'tl', fmt(tl), 'tu', ARGV[1])
    keep_for(KEYS[3 * i - 2], math.ceil(wait_for(tpm, tl, tpm)) + margin)
  end
  if ARGV[5 + 2 * i] == '1' then  -- step 6, settled_budget
    local used = redis.call('GET', KEYS[3 * i - 1])
    if used then  -- a vanished counter is reseeded from the ledger, which this request will be part of
      redis.call('SET', KEYS[3 * i - 1], math.max(0, tonumber(used) - delta), 'KEEPTTL')
    end
  end
  redis.call('ZREM', KEYS[3 * i], ARGV[3])
end
return 1
"""
