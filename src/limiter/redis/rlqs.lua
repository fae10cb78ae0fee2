-- ratelimitd: one participant's share of an RLQS pool, decided in one atomic step.
--
-- Why a script: replicas on one Redis share a pool. Recording a grant against what the others
-- hold must be one step, or two replicas both see the same free capacity and both hand it
-- out. Time is Redis TIME (ms), so leases expire on one clock. The arithmetic mirrors
-- src/rlqs/fair_share.rs (a test runs the 'shares' operation against the Rust function on the same
-- inputs) and the pool mirrors src/rlqs/pool.rs: a grant is O(1) against running sums, and
-- the fair shares are recomputed apart from it.
--
-- Cost per call, whatever the pool's size: a grant or leave reads and writes its own member
-- and the pool's running sums and sorted demands (O(log n)), and advances the recomputation
-- of the shares by at most STEPS members (a pass: scan every member, expiring what ran out,
-- then walk the demands in order to find the water level). A pass over n members takes about
-- 2n/STEPS calls; until it ends, grants follow the shares of the pass before. They never take
-- more than the others' leases leave, so the limit holds all the same.
--
-- KEYS[1]    the pool: a hash. Field = member id (`<replica>.<participant>`, hex), value =
--            `<demand> <tokens> <max_tokens> <lease until ms> <alive until ms>`, demand in
--            tokens per window or `-` when not measured. A member is connected while `alive
--            until` is ahead (its replica refreshes it at each grant); its `tokens` count
--            against the limit until a pass finds `lease until` behind and zeroes them. A
--            member with neither is deleted. Field `#` holds the pool's state (see `load`).
--            The key expires when the last lease or liveness would.
-- KEYS[2]    the connected members' demands in order: a sorted set (score = demand or 0,
--            member id), written by each grant and leave (a member whose replica died is
--            taken out by the scan); same slot as KEYS[1].
-- ARGV[1]    "grant", "leave" or "shares"
--
-- grant, leave:
-- ARGV[2]    member id
-- ARGV[3]    limit (tokens per window, > 0)
-- ARGV[4]    burst (tokens at once, over all members)
-- ARGV[5]    lease (ms): how long a grant is held (the assignment TTL)
-- ARGV[6]    liveness (ms): how long a member counts as connected after a grant
-- ARGV[7]    demand (grant: tokens per window; `-` none)
-- ARGV[8..9] floor of an equal split, headroom (the Rust constants)
-- grant records the member's demand, makes it connected, and grants it its fair share within
-- what the others' leases leave (whole tokens, at least one); leave makes it disconnected (its
-- lease still counts). Both return {tokens, max_tokens, pass} and, when `pass` is 1 (a pass
-- ended in this call: the shares moved), the new shares' terms as strings: {level, extra,
-- floor, capacity}, and the tokens of the limit no grant holds (an integer); a member's share
-- is share_of(ask, level, extra), its ask being its demand with headroom, at most the capacity
-- and at least the floor (level `inf`: every ask is met).
-- Leave's tokens are 0. {-1}: the key holds data this service did not write; nothing written.
--
-- shares (pure: no key read or written):
-- ARGV[2..3] floor of an equal split, headroom
-- ARGV[4]    capacity
-- ARGV[5..]  demands (`-` none)
-- returns the fair shares, as strings (`%.17g`: Redis would truncate a number to an integer).

local floor, max, min = math.floor, math.max, math.min
-- Members a call walks: fewer than 16 cost less Redis CPU per report, since fewer passes end
-- and so fewer pushes follow (docs/performance.md, "Measurements behind the code").
local STEPS = 8
local op = ARGV[1]

-- What a demand asks: with headroom, at most the capacity, at least the floor (none: the floor).
local function ask(d, cap, least, headroom)
  if d and d > 0 then return max(min(d * headroom, cap), least) end
  return least
end

-- One step of the water-filling walk over demands in ascending order (see fair_shares in
-- fair_share.rs): `w` = {k = members walked, n, left, cap, least, headroom}. Returns the level when
-- this member's ask is above an equal split of what is left (every later member gets the
-- level), else nil and takes the ask.
local function walk(w, d)
  local a = ask(d, w.cap, w.least, w.headroom)
  local equal = w.left / (w.n - w.k)
  if a > equal then return equal end
  w.left = w.left - a
  w.k = w.k + 1
  return nil
end

local function new_walk(n, cap, floor_frac, headroom)
  cap = max(cap, 0)
  local least = 0
  if n > 0 then least = cap / n * floor_frac end
  return {k = 0, n = n, left = cap, cap = cap, least = least, headroom = headroom}
end

-- A share from its ask and a pass's terms: the ask up to the level, and of the extra at most
-- as much again (share_of in fair_share.rs: the rest of a pool far from its limit stays unheld
-- for a newcomer, since a grant is held until its lease ends).
local function share_of(a, level, extra)
  local met = min(a, level)
  return met + min(extra, met)
end

-- The end of a walk: the level (math.huge when every ask was met) and what nobody asked,
-- split equally (each member takes of it at most its own ask: share_of).
local function finish(w, level)
  if level then return level, 0 end
  local extra = 0
  if w.left > 0 and w.n > 0 then extra = w.left / w.n end
  return math.huge, extra
end

if op == 'shares' then
  local floor_frac, headroom, capacity = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
  local demands, n = {}, #ARGV - 4
  for i = 1, n do demands[i] = tonumber(ARGV[i + 4]) end
  local w = new_walk(n, capacity, floor_frac, headroom)
  local order = {}
  for i = 1, n do order[i] = i end
  local asks = {}
  for i = 1, n do asks[i] = ask(demands[i], w.cap, w.least, headroom) end
  table.sort(order, function(a, b)
    if asks[a] ~= asks[b] then return asks[a] < asks[b] end
    return a < b
  end)
  local level
  for _, i in ipairs(order) do
    level = walk(w, demands[i])
    if level then break end
  end
  local extra
  level, extra = finish(w, level)
  local out = {}
  for i = 1, n do out[i] = string.format('%.17g', share_of(asks[i], level, extra)) end
  return out
end

local key, order_key, me_id = KEYS[1], KEYS[2], ARGV[2]
local limit, burst = tonumber(ARGV[3]), tonumber(ARGV[4])
local lease_ms, alive_ms = tonumber(ARGV[5]), tonumber(ARGV[6])
local demand = tonumber(ARGV[7])
local floor_frac, headroom = tonumber(ARGV[8]), tonumber(ARGV[9])

local kind = redis.call('TYPE', key)['ok']
if kind ~= 'hash' and kind ~= 'none' then return {-1} end
local okind = redis.call('TYPE', order_key)['ok']
if okind ~= 'zset' and okind ~= 'none' then return {-1} end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + floor(tonumber(t[2]) / 1000)

local function parse(v)
  local d, tk, mx, u, a = string.match(v, '^(%S+) (%d+) (%d+) (%d+) (%d+)$')
  if not d then return nil end
  return {demand = tonumber(d), tokens = tonumber(tk), max = tonumber(mx), lease = tonumber(u),
    alive = tonumber(a)}
end
local function encode(x)
  local d = '-'
  if x.demand then d = string.format('%.17g', x.demand) end
  return string.format('%s %d %d %d %d', d, x.tokens, x.max, x.lease, x.alive)
end

-- The pool's state, field `#`: held (tokens of every member: the sum grants are made against),
-- the pass in progress (phase `s` scanning from `cursor`, counting the connected and the
-- disconnected members' leases; phase `w` walking the sorted demands from rank `k` with `left`
-- of the capacity `wcap` and the floor `wleast`), and the last pass's terms (n, level, extra,
-- floor, capacity), which grants follow until the pass in progress ends: a grant never mixes
-- the terms of two passes.
local S
local raw = redis.call('HGET', key, '#')
if raw then
  local f = {}
  for x in string.gmatch(raw, '%S+') do f[#f + 1] = x end
  -- 12 fields: written before the walk kept its own floor and capacity (it then used the
  -- last pass's, which is what those pools get until their walk starts again).
  if #f ~= 14 and #f ~= 12 then return {-1} end
  S = {held = tonumber(f[1]), phase = f[2], cursor = f[3], live = tonumber(f[4]),
    leased = tonumber(f[5]), k = tonumber(f[6]), left = tonumber(f[7]), n = tonumber(f[8]),
    level = tonumber(f[9]), extra = tonumber(f[10]), least = tonumber(f[11]),
    cap = tonumber(f[12]), wleast = tonumber(f[13] or f[11]), wcap = tonumber(f[14] or f[12])}
  if not S.held or not S.level or not S.wcap then return {-1} end
else
  -- A new pool (or one written before the state existed: its tokens summed once).
  S = {held = 0, phase = 's', cursor = '0', live = 0, leased = 0, k = 0, left = 0, n = 0,
    level = 0, extra = 0, least = 0, cap = 0, wleast = 0, wcap = 0}
  redis.call('DEL', order_key)
  local all = redis.call('HGETALL', key)
  for i = 1, #all, 2 do
    local x = parse(all[i + 1])
    if not x then return {-1} end
    S.held = S.held + x.tokens
    if x.alive > now then redis.call('ZADD', order_key, x.demand or 0, all[i]) end
  end
end

-- This call's member, read once and written at the end.
local me
do
  local v = redis.call('HGET', key, me_id)
  if v then
    me = parse(v)
    if not me then return {-1} end
  end
end
if op == 'grant' then
  if not me then me = {tokens = 0, max = 0, lease = 0} end
  me.demand = demand
  me.alive = now + alive_ms
  redis.call('ZADD', order_key, demand or 0, me_id)
elseif me then
  me.alive = 0
  redis.call('ZREM', order_key, me_id)
end

-- Advances the pass by at most STEPS members. Returns true when it ended here.
local function step()
  local steps = STEPS
  while steps > 0 do
    if S.phase == 's' then
      local r = redis.call('HSCAN', key, S.cursor, 'COUNT', steps)
      local pairs_ = r[2]
      for i = 1, #pairs_, 2 do
        local id = pairs_[i]
        if id ~= '#' and id ~= me_id then
          local x = parse(pairs_[i + 1])
          if not x then return nil end
          local dirty = false
          if x.lease <= now and x.tokens > 0 then
            S.held = S.held - x.tokens
            x.tokens, dirty = 0, true
          end
          if x.alive <= now then
            -- Disconnected without a leave (its replica died): out of the demands.
            redis.call('ZREM', order_key, id)
          end
          if x.alive <= now and x.lease <= now then
            redis.call('HDEL', key, id)
          else
            if dirty then redis.call('HSET', key, id, encode(x)) end
            if x.alive <= now then S.leased = S.leased + x.tokens end
          end
        end
      end
      steps = steps - max(#pairs_ / 2, 1)
      S.cursor = r[1]
      if S.cursor == '0' then
        -- This call's member is counted as it is now, not as the scan would have seen it.
        if me and me.alive <= now and me.lease > now then S.leased = S.leased + me.tokens end
        local w = new_walk(redis.call('ZCARD', order_key), limit - S.leased, floor_frac, headroom)
        S.phase, S.k, S.left, S.live, S.wcap, S.wleast = 'w', 0, w.left, w.n, w.cap, w.least
      end
    else
      local w = {k = S.k, n = S.live, left = S.left, cap = S.wcap, least = S.wleast,
        headroom = headroom}
      local batch = redis.call('ZRANGE', order_key, S.k, S.k + steps - 1, 'WITHSCORES')
      local level
      for i = 2, #batch, 2 do
        -- Members granted since the pass counted them wait for the next pass.
        if w.k >= w.n then break end
        level = walk(w, tonumber(batch[i]))
        if level then break end
      end
      steps = steps - max(#batch / 2, 1)
      S.k, S.left = w.k, w.left
      if level or w.k >= w.n or #batch == 0 then
        S.level, S.extra = finish(w, level)
        S.n, S.cap, S.least = w.n, w.cap, w.least
        S.phase, S.cursor, S.live, S.leased, S.k, S.left = 's', '0', 0, 0, 0, 0
        return true
      end
    end
  end
  return false
end
local passed = step()
if passed == nil then return {-1} end

local function whole(s) return max(floor(s), 1) end

local tokens, max_tokens = 0, 0
if op == 'grant' then
  local others = S.held - me.tokens
  local share = 0
  if S.n > 0 then share = share_of(ask(me.demand, S.cap, S.least, headroom), S.level, S.extra) end
  tokens = max(min(whole(share), max(limit - others, 0)), 1)
  max_tokens = max(floor(burst * tokens / limit), 1)
  S.held = others + tokens
  me.tokens, me.max, me.lease = tokens, max_tokens, now + lease_ms
end

if me then
  if me.lease > now or me.alive > now then
    redis.call('HSET', key, me_id, encode(me))
  else
    S.held = S.held - me.tokens
    redis.call('HDEL', key, me_id)
  end
end
local level = 'inf'
if S.level < math.huge then level = string.format('%.17g', S.level) end
redis.call('HSET', key, '#',
  string.format('%d %s %s %d %.17g %d %.17g %d %s %.17g %.17g %.17g %.17g %.17g',
  S.held, S.phase, S.cursor, S.live, S.leased, S.k, S.left, S.n, level, S.extra, S.least, S.cap,
  S.wleast, S.wcap))
local ttl = max(lease_ms, alive_ms)
redis.call('PEXPIRE', key, ttl)
if redis.call('EXISTS', order_key) == 1 then redis.call('PEXPIRE', order_key, ttl) end

if passed then
  return {tokens, max_tokens, 1, level, string.format('%.17g', S.extra),
    string.format('%.17g', S.least), string.format('%.17g', S.cap), max(limit - S.held, 0)}
end
return {tokens, max_tokens, 0}
