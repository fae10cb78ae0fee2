-- ratelimitd: one participant's share of an RLQS quota pool, decided in one atomic step.
--
-- Why a script: replicas on one Redis share a pool. Reading its members, computing the fair
-- shares and recording a grant must be one step, or two replicas both see the same free
-- capacity and both hand it out. Time is Redis TIME (ms), so leases expire on one clock.
-- The arithmetic mirrors src/quota/share.rs and src/quota/pool.rs (the memory backend's
-- pools); a test runs the 'shares' operation against the Rust function on the same inputs.
--
-- KEYS[1]    the pool: a hash, field = member id (`<replica>.<participant>`, hex), value =
--            `<demand> <tokens> <max_tokens> <lease until ms> <alive until ms>`, demand in
--            tokens per window or `-` when not measured. A member is connected while `alive
--            until` is ahead (its replica refreshes it at each grant); its grant is a lease
--            that counts against the limit until `lease until`, connected or not. A member
--            with neither is deleted. The key expires when the last lease or liveness would.
-- ARGV[1]    "grant", "leave" or "shares"
--
-- grant, leave:
-- ARGV[2]    member id
-- ARGV[3]    limit (tokens per window, > 0)
-- ARGV[4]    burst (tokens at once, over all members)
-- ARGV[5]    lease (ms): how long a grant is held (the assignment TTL)
-- ARGV[6]    liveness (ms): how long a member counts as connected after a grant
-- ARGV[7]    demand (grant: tokens per window; `-` none)
-- ARGV[8..10] floor of an equal split, headroom, share move (the Rust constants)
-- grant records the member's demand, makes it connected, and grants it its fair share within
-- what the others' leases leave (whole tokens, at least one); leave makes it disconnected (its
-- lease still counts). Both return {tokens, max_tokens, then the ids of connected members whose
-- share moved far enough from what they hold to push them a new grant}; leave's tokens are 0.
-- {-1}: the key holds data this service did not write; nothing is written.
--
-- shares (pure: no key read or written):
-- ARGV[2..3] floor of an equal split, headroom
-- ARGV[4]    capacity
-- ARGV[5..]  demands (`-` none)
-- returns the fair shares, as strings (`%.17g`: Redis would truncate a number to an integer).

local floor, max, min, abs = math.floor, math.max, math.min, math.abs
local op = ARGV[1]

-- Max-min fair shares of `capacity` among `n` demands (nil: none): see fair_shares in share.rs.
local function fair_shares(capacity, demands, n, floor_frac, headroom)
  local shares = {}
  if n == 0 then return shares end
  capacity = max(capacity, 0)
  local least = capacity / n * floor_frac
  local asks, order = {}, {}
  for i = 1, n do
    local d = demands[i]
    if d and d > 0 then asks[i] = max(min(d * headroom, capacity), least) else asks[i] = least end
    order[i] = i
  end
  table.sort(order, function(a, b)
    if asks[a] ~= asks[b] then return asks[a] < asks[b] end
    return a < b
  end)
  local left = capacity
  for k = 1, n do
    local i = order[k]
    local equal = left / (n - k + 1)
    shares[i] = min(asks[i], equal)
    left = left - shares[i]
  end
  if left > 0 then
    local extra = left / n
    for i = 1, n do shares[i] = shares[i] + extra end
  end
  return shares
end

if op == 'shares' then
  local floor_frac, headroom, capacity = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
  local demands, n = {}, #ARGV - 4
  for i = 1, n do demands[i] = tonumber(ARGV[i + 4]) end
  local out = {}
  for i, s in ipairs(fair_shares(capacity, demands, n, floor_frac, headroom)) do
    out[i] = string.format('%.17g', s)
  end
  return out
end

local key, me_id = KEYS[1], ARGV[2]
local limit, burst = tonumber(ARGV[3]), tonumber(ARGV[4])
local lease_ms, alive_ms = tonumber(ARGV[5]), tonumber(ARGV[6])
local demand = tonumber(ARGV[7])
local floor_frac, headroom, share_move = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])

local kind = redis.call('TYPE', key)['ok']
if kind ~= 'hash' and kind ~= 'none' then return {-1} end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + floor(tonumber(t[2]) / 1000)

-- The members that still count, in the hash's order.
local ids, m = {}, {}
local raw = redis.call('HGETALL', key)
for i = 1, #raw, 2 do
  local d, tk, mx, u, a = string.match(raw[i + 1], '^(%S+) (%d+) (%d+) (%d+) (%d+)$')
  if not d then return {-1} end
  u, a = tonumber(u), tonumber(a)
  if u <= now and a <= now then
    redis.call('HDEL', key, raw[i])
  else
    ids[#ids + 1] = raw[i]
    m[raw[i]] = {demand = tonumber(d), tokens = tonumber(tk), max = tonumber(mx), lease = u, alive = a}
  end
end

local me = m[me_id]
if op == 'grant' then
  if not me then
    me = {tokens = 0, max = 0, lease = 0}
    m[me_id] = me
    ids[#ids + 1] = me_id
  end
  me.demand = demand
  me.alive = now + alive_ms
elseif me then
  me.alive = 0
end

local function held(x)
  if x.lease > now then return x.tokens end
  return 0
end
local function whole(s) return max(floor(s), 1) end

-- Shares of what the disconnected members' leases leave, among the connected.
local leased, live, demands = 0, {}, {}
for _, id in ipairs(ids) do
  local x = m[id]
  if x.alive > now then
    live[#live + 1] = id
    demands[#live] = x.demand
  else
    leased = leased + held(x)
  end
end
local share = {}
for i, s in ipairs(fair_shares(max(limit - leased, 0), demands, #live, floor_frac, headroom)) do
  share[live[i]] = s
end

local tokens, max_tokens, before = 0, 0, 0
if op == 'grant' then
  local others = 0
  for _, id in ipairs(ids) do
    if id ~= me_id then others = others + held(m[id]) end
  end
  before = held(me)
  tokens = max(min(whole(share[me_id]), max(limit - others, 0)), 1)
  max_tokens = max(floor(burst * tokens / limit), 1)
  me.tokens, me.max, me.lease = tokens, max_tokens, now + lease_ms
end

local function encode(x)
  local d = '-'
  if x.demand then d = string.format('%.17g', x.demand) end
  return string.format('%s %d %d %d %d', d, x.tokens, x.max, x.lease, x.alive)
end
if me then
  if me.lease > now or me.alive > now then
    redis.call('HSET', key, me_id, encode(me))
  else
    redis.call('HDEL', key, me_id)
  end
end
if redis.call('EXISTS', key) == 1 then
  redis.call('PEXPIRE', key, max(lease_ms, alive_ms))
end

-- Whom to push: a share far from what its member holds, or, when this grant freed capacity,
-- anyone holding less than its share.
local out = {tokens, max_tokens}
for _, id in ipairs(live) do
  if id ~= me_id then
    local h = held(m[id])
    if h > 0 then
      local next_tokens = whole(share[id])
      if abs(next_tokens - h) > max(h * share_move, 1) or (tokens < before and h < share[id]) then
        out[#out + 1] = id
      end
    end
  end
end
return out
