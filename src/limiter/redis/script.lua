-- ratelimitd: decide (or undo) every counter of one request in one atomic step.
--
-- Why a script: checking several counters and then committing them must be one step, or two
-- replicas both read 99 of 100 and both admit; and the window must come from one clock (Redis
-- TIME), not from each replica's. Since Redis 5 scripts replicate their effects, so TIME here
-- is safe. The math mirrors src/limiter/algorithm.rs (the memory backend); Lua numbers are
-- doubles, exact for microsecond timestamps and for counts below 2^53.
--
-- One call decides the requests coalesced into it, one after another, each all-or-nothing on
-- its own, exactly as if each had been its own call at the same instant: coalescing changes no
-- decision, it only spares Redis a script call (and the client a round trip) per request.
--
-- It runs two ways, the same code: as a function library (FUNCTION LOAD with a header that
-- names it; then FCALL), where everything outside `main` is built once per load, and by
-- EVALSHA (Redis before 7, or a user who may not load functions), where the whole file runs
-- on every call. Nothing outside `main` may carry state from one call to the next: each call
-- sets what it reads. (Building the helpers and tables was a quarter of a lone request's cost.)
--
-- KEYS       every distinct counter of the call, once. All share one cluster slot (standalone
--            Redis: any keys).
--            fixed_window: string `<count>@<window start µs>`, expires at the window end. The
--              window's identity is in the value: Redis judges a key's expiry by the time the
--              script started while TIME may already be in the next window, so a key read at a
--              boundary could otherwise pass for the current window and be written past its
--              end. (A bare count, as an earlier version wrote, is read as the current window's.)
--            sliding_window: hash {s = window start, p = previous count, c = current count}
--            sliding_log: sorted set, one member per admitted request and limit, scored by its time
--              (µs) and named `<nonce>:<i>:<hits>` (so its weight is in its name), plus the
--              member `#` scored -(total hits in the log): O(1) work per call however many hits
--              a request carries (a member per hit let one request block Redis for seconds)
--            token_bucket: string GCRA theoretical arrival time (µs)
-- ARGV[1]    "decide" or "undo"
-- ARGV[2]    every number of the call, packed: little-endian doubles back to back, read with
--            struct.unpack (as text each cost Redis a strtod: a fifth of a lone request's cost)
-- ARGV[3..]  the nonces, one per entry that has one (below), in the entries' order
-- The numbers, in order:
--   E        how many entries this call carries (an entry stands for one request or more)
--   C        how many counters
--   D        how far past its limit a cost report may take a counter, in limits (--max-debt)
-- then per counter c (C times; the same key may come twice with different limits, e.g. from
-- requests on either side of a config reload), its key being KEYS[k] with k from the first field:
--   k, algorithm (1 fixed_window, 2 sliding_window, 3 sliding_log, 4 token_bucket, 5 a
--   fixed_window on a calendar), requests_per_unit, window (µs), burst
--   and for a calendar (5) four window boundaries b0 < b1 < b2 < b3 (µs): the windows [b0, b1),
--   [b1, b2) and [b2, b3), around where the client expects Redis' time to be. The one holding
--   this call's TIME is the counter's window (its length is b(i+1) - b(i): a day may be 23
--   hours, a month 28 days); the calendar's arithmetic (zones, daylight saving) stays in the
--   client, the clock that picks the window is Redis'. When none holds TIME (the client's idea
--   of Redis' time was off by more than a window), every request naming the counter is answered
--   admitted = -2 and zeros, and nothing is written for it: the client asks again with
--   boundaries around the TIME this reply carries.
-- then per entry (E of them), decide:
--   m        the entry stands for m identical requests in a row, decided one after another
--   n        how many limits each has
--   3 per limit: its counter c (1..C), hits (at most Limit::most_hits: a larger amount decides
--            as that one, and every count stays an exact integer in a double, below 2^53),
--            and how, one number: the enforcement (1 E: over
--            rejects; 2 Q: rejects only if every Q is over; 3 S: never rejects), plus 3 for a
--            cost report, plus 6 for a refund (see "Kinds" below)
--   and a nonce (ARGV) only when one of its limits is a sliding_log: unique to the request, it
--            names the request's log members (so an undo can find them); such an entry has m = 1
-- undo (one request per entry; another slot group of the request rejected it):
--   at       the decide's time (µs), as returned by decide
--   marker   the KEYS index of the request's undo marker (`<prefix>{<tag>}` then
--            `undo:<nonce>`, in the slot of its keys): SET NX before undoing, so an undo that a
--            client retries after an I/O error gives back only once
--   n, then 3 per limit as for decide, hits being what the limit's decide CONSUMED as an
--            admission (0 for one that was over, a report or a refund), so an undo never gives
--            back what was never taken
--   and the decide's nonce (ARGV).
--
-- Kinds. An admission (a request asking to pass) is all-or-nothing: consumed only if the whole
-- request is admitted. A cost report (usage that already happened, sent when a stream is done)
-- is recorded whether it fits or not; past the limit it is debt, kept up to D limits' worth
-- (fixed_window, sliding_window and sliding_log: the count at most (1 + D) × requests_per_unit;
-- token_bucket: at most D × requests_per_unit tokens below empty). A refund gives its hits back
-- before the request's other limits are checked, never below an empty counter, and never
-- rejects. A check of 0 hits asks whether one more unit fits: it is over once nothing is left.
--
-- Limits are sent once per counter, keys once per call and identical requests once per run,
-- not once per request: parsing arguments was most of what Redis spent on a coalesced request.
--
-- The reply is one string: its values as little-endian doubles back to back (struct.pack), as
-- the arguments come. As an array of integers, Redis wrote each as text and the client parsed
-- it back: redis-rs took 29.9 µs for a call of 53 requests of two limits (265 values), 0.95 µs
-- packed. The values are the call's time (Redis TIME, µs), then every request's in order:
-- decide: admitted (1 or 0), then per limit: its room, and its reset (µs), and for a
--   concurrency limit two more values: what the request did to its places, 2 + the change (-1
--   a place released, 1 one taken, 0 none) + 4 × the places that ended unreleased and were
--   dropped meanwhile, and when the place taken or released ends (µs; 0 for none). The client
--   keeps a gauge of places in use from these.
--   The room is what is left when within (>= 0), and -1 - (how many hits would have fit) when
--   over (for statistics): one value where two would say the same. Nothing is written for a request
--   unless it is admitted; then every limit that fits is consumed and every key written gets
--   an expiry.
-- undo: 1. It takes back what an admitted decide of the same KEYS and ARGV consumed.
--
-- Each request succeeds or fails on its own: one whose counter holds foreign data (a key of the
-- wrong type, a value that is not ours) gets admitted = -1 and zeros (a calendar counter whose
-- boundaries miss TIME: -2, see above), nothing is written for it,
-- and the call's other requests are decided as usual. An error that means Redis cannot serve
-- now (OOM, NOREPLICAS, MISCONF, READONLY, LOADING, MASTERDOWN, BUSY) fails the whole call: it
-- would fail every request alike, and the client's failure mode answers them.

-- Set on the first call: a library's top level may not read the standard libraries.
local floor, ceil, max, min, unpack_numbers, pack_numbers, unpack_values
-- The codes the numbers carry for algorithms and enforcements (a limit's "how" is its
-- enforcement, plus 3 for a report, plus 6 for a refund; see main).
-- (5, a fixed_window on a calendar, is read apart; 6 is a concurrency limit's places.)
local ALGORITHMS = {'f', 's', 'w', 'b', 'f', 'c'}
local ENFORCEMENTS = {'E', 'Q', 'S'}
-- The call's counters: key, algorithm, requests_per_unit, window, burst, the start of the
-- window the call's time is in, and its state once read (false until then; see `cache`).
local c_key, c_algo, c_rpu, c_w, c_burst, c_start, c_st = {}, {}, {}, {}, {}, {}, {}
-- Calendar counters: whether the counter is one, its four boundaries, and whether none of its
-- windows holds the call's time (see the header).
local c_cal, c_b0, c_b1, c_b2, c_b3, c_stale = {}, {}, {}, {}, {}, {}
-- A counter's hold keys (false when its node keeps no holds): a rate limit's holds by end, and
-- their hits; in the second, for a rate limit and a concurrency limit alike, the releases each
-- live hold owes to admissions refused for naming it (field OWED .. id), and a sliding_log
-- hold's time taken (field TAKEN_AT .. id: its end, that time plus a window, is a double past
-- 2^53 µs for a window of centuries, and would no longer name its entry). An id starts with =
-- or #, so no id is such a field.
local c_hk, c_hh = {}, {}
local OWED, TAKEN_AT = '!', '@'
-- The request being decided: its nonce, how many limits it has, and per limit its counter, the
-- counter's algorithm, hits (0 for a refund, whose hits are in l_back), enforcement and kind
-- (reused from request to request: only 1..n are read); whether it has refunds, and reports.
local nonce, n = '', 0
local l_c, l_algo, l_hits, l_enf, l_kind, l_back = {}, {}, {}, {}, {}, {}
-- Per limit, the hold it names: false (its node keeps none), 'u' (it keeps them, none named),
-- or the hold's id (a string of ARGV).
local l_hold = {}
-- Per concurrency limit of the request: the change it made to the places (-1, 0 or 1), when
-- that place ends, the places that ended unreleased and were dropped, and where its third
-- reply value is.
local l_delta, l_end, l_ended, l_out = {}, {}, {}, {}
local refunds, reports = false, false
-- Whether one of the request's limits names a hold: then (and only then) `holding.settle` and
-- `holding.take` run, so that a request naming none pays nothing per limit for holds.
local named = false
-- The reply's values so far (`#out` is a search each time: keep the length here). One table
-- for every call (as `cache` and `order`): a table that grows costs Redis a resize at each
-- power of two, and the garbage collector its memory, call after call. Only 1..out_n is sent.
local out, out_n = {}, 0
-- Per limit of the current request: the check's verdict, the counter state it read, and (a
-- token bucket admission) the arrival time a commit writes. Per limit, not per state: a
-- request may name one counter twice (a refund and an admission).
local over, state, next_tat = {}, {}, {}

-- The call's Redis TIME (µs), and how far past its limit a report may take a counter.
local now, debt = 0, 0

-- The window of calendar counter c that holds `t`: its start and length, or nil when none does.
local function window_in(c, t)
  local b0, b1, b2, b3 = c_b0[c], c_b1[c], c_b2[c], c_b3[c]
  if t >= b1 then
    if t < b2 then return b1, b2 - b1 end
    if t < b3 then return b2, b3 - b2 end
  elseif t >= b0 then
    return b0, b1 - b0
  end
  return nil
end

local function expiry_ms(at_us)
  -- Expiries are in ms and a key lives while now_ms <= at_ms, so expire at the last ms before
  -- `at_us` (window ends are whole seconds) or, for unaligned times, the ms after it.
  local at_ms = ceil(at_us / 1000)
  if at_us % 1000000 == 0 then at_ms = at_ms - 1 end
  return at_ms
end

local function expire_at_us(key, at_us)
  redis.call('PEXPIREAT', key, expiry_ms(at_us))
end

-- Limit i of the current request: key, algorithm, requests_per_unit, window, burst, hits.
local function limit(i)
  local c = l_c[i]
  return c_key[c], c_algo[c], c_rpu[c], c_w[c], c_burst[c], l_hits[i]
end

local function member(i, hits)
  return nonce .. ':' .. i .. ':' .. hits
end

-- sliding_log bounds: entries pruned per call, entries scanned for a rejected request's reset,
-- and entries a refund removes or shortens. Each keeps one call's work constant; see log_total,
-- log_wait and give_back. (The last two are LOG_SCAN_MAX and LOG_REFUND_MAX in algorithm.rs.)
local LOG_PRUNE_MAX = 1000
local LOG_SCAN_MAX = 128
local LOG_REFUND_MAX = 1000

-- Stores a weighted log's total in its `#` member (negated, so that it scores below every
-- entry's time), or drops the member when nothing is left.
local function set_log_total(key, total)
  if total <= 0 then
    redis.call('ZREM', key, '#')
  else
    redis.call('ZADD', key, -total, '#')
  end
end

-- The weighted log's total after dropping (up to LOG_PRUNE_MAX) entries at or before `upto`.
-- Entries left unpruned still count: an over-count, which may over-reject until the next
-- call prunes them, never over-admits.
local function log_total(key, upto)
  local total = -tonumber(redis.call('ZSCORE', key, '#') or '0')
  if total <= 0 then return 0 end
  local old = redis.call('ZRANGEBYSCORE', key, 0, upto, 'LIMIT', 0, LOG_PRUNE_MAX)
  if #old > 0 then
    local freed = 0
    for _, m in ipairs(old) do freed = freed + tonumber(string.match(m, ':(%d+)$')) end
    redis.call('ZREM', key, unpack(old))
    total = max(total - freed, 0)
    set_log_total(key, total)
  end
  return total
end

-- How long until `to_free` logged hits have left the window, scanning at most LOG_SCAN_MAX
-- entries (oldest first); past that, a whole window (an upper bound). Mirrors the memory backend.
local function log_wait(key, to_free, w)
  local oldest = redis.call('ZRANGEBYSCORE', key, 0, '+inf', 'WITHSCORES', 'LIMIT', 0, LOG_SCAN_MAX)
  for j = 1, #oldest, 2 do
    local n = tonumber(string.match(oldest[j], ':(%d+)$'))
    if n >= to_free then return tonumber(oldest[j + 1]) + w - now end
    to_free = to_free - n
  end
  return w
end

-- Counters read once per call: a call's requests often share keys (a hot route, one client's
-- burst), so fixed_window, sliding_window and token_bucket state is read on first use, kept
-- here while the call's requests are decided in order, and written once at the end. Each
-- request still sees every earlier request's commits, so decisions are those of separate calls.
-- (sliding_log writes a member per request and is read and written directly.) Callers look in
-- `cache` first and call `cached` only on a miss: a Lua call per limit and request cost a
-- measurable share of a large call (docs/performance.md, "Measurements behind the code"). The
-- check looks in `c_st` by counter first, sparing the key's lookup for every further request.
-- A state's window (`w`) is its counter's: a key names its algorithm and window.
-- Both are emptied when a call starts (`order` names every key `cache` holds). The states
-- themselves are tables kept from call to call (`pool`, by their place in `order`), each set
-- anew by its `load`: a table built per counter and call, and each of its fields a new key,
-- was a tenth of what a call of one request cost Redis, with the garbage it left. What they
-- keep is bounded by the largest call: its reply, and a table per counter.
local cache, order, order_n, pool = {}, {}, 0, {}

-- A miss: `key`'s state, read by `load` into a table of the pool, with its window `w`, kept for
-- the rest of the call.
local function cached(key, load, w)
  local at = order_n + 1
  local st = load(key, pool[at])
  pool[at] = st
  st.w = w
  cache[key] = st
  order_n = at
  order[at] = key
  return st
end

local function foreign(key)
  error('ratelimitd: a counter holds a value this service did not write')
end

-- Each load fills the pool's table `st` (setting every field its algorithm reads: the table
-- may hold another's from an earlier call) or, when the pool has none there, builds one with
-- a constructor, at its size at once (under EVAL the pool is new on every call), and returns
-- the state.
local function load_f(key, st)
  local v = redis.call('GET', key)
  -- `read`: the window of the value read.
  if st then
    st.algo, st.count, st.start, st.dirty, st.read = 'f', 0, -1, false, false
  else
    st = {algo = 'f', count = 0, start = -1, dirty = false, read = false, w = 0}
  end
  if v then
    local c, s = string.match(v, '^(%d+)@(%d+)$')
    if c then
      st.count, st.start = tonumber(c), tonumber(s)
      st.read = st.start
    else
      st.count, st.start = tonumber(v), 'legacy'
      if not st.count then foreign(key) end
    end
  end
  return st
end

local function f_value(count, start)
  return string.format('%d@%d', count, start)
end

local function load_s(key, st)
  local h = redis.call('HMGET', key, 's', 'p', 'c')
  local s, p, c = tonumber(h[1] or '-1'), tonumber(h[2] or '0'), tonumber(h[3] or '0')
  if not (s and p and c) then foreign(key) end
  if st then
    st.algo, st.s, st.p, st.c, st.delta, st.rolled, st.rewrite = 's', s, p, c, 0, false, false
  else
    st = {algo = 's', s = s, p = p, c = c, delta = 0, rolled = false, rewrite = false, w = 0}
  end
  return st
end

local function load_b(key, st)
  local tat = tonumber(redis.call('GET', key) or '0')
  if not tat then foreign(key) end
  if st then
    st.algo, st.tat, st.dirty = 'b', tat, false
  else
    st = {algo = 'b', tat = tat, dirty = false, w = 0}
  end
  return st
end

-- Brings a fixed_window state to the window starting at `start`.
local function roll_f(st, start)
  if st.start == 'legacy' then
    st.start = start
  elseif st.start ~= start then -- another window's value, or none: this window starts empty
    st.count, st.start = 0, start
  end
end

-- Brings a sliding_window state to the window starting at `start`.
local function roll_s(st, start, w)
  if st.s ~= start then
    if st.s == start - w then st.p = st.c else st.p = 0 end
    st.c, st.s, st.rolled = 0, start, true
  end
end

local function flush()
  for i = 1, order_n do
    local key = order[i]
    local st = cache[key]
    if st.algo == 'f' then
      if st.dirty then
        if st.start == st.read then -- the window it was read in: its expiry is already that
          redis.call('SET', key, f_value(st.count, st.start), 'KEEPTTL')
        else
          redis.call('SET', key, f_value(st.count, st.start), 'PXAT',
            string.format('%d', expiry_ms(st.start + st.w)))
        end
      end
    elseif st.algo == 's' then
      -- A new key or window, or a refund: rewrite it, with its expiry.
      if st.rewrite or (st.rolled and st.delta > 0) then
        redis.call('HSET', key, 's', st.s, 'p', st.p, 'c', st.c)
        expire_at_us(key, st.s + 2 * st.w)
      elseif st.delta > 0 then
        redis.call('HINCRBY', key, 'c', st.delta)
      end
    elseif st.algo == 'b' and st.dirty then
      redis.call('SET', key, string.format('%.3f', st.tat), 'PXAT', expiry_ms(st.tat + 1))
    end
  end
end

-- Takes back what an admitted decide made at `at` consumed (mode "undo").
local function undo(at)
  for i = 1, n do
    local key, algo, rpu, w, burst, hits = limit(i)
    local hold = l_hold[i]
    if hits > 0 and hold and hold ~= 'u' then
      -- The hold the decide took goes with what it took.
      local hk = c_hk[l_c[i]]
      if algo == 'c' then
        redis.call('ZREM', key, hold)
      elseif hk then
        redis.call('ZREM', hk, hold)
        redis.call('HDEL', c_hh[l_c[i]], hold, TAKEN_AT .. hold)
      end
    end
    if hits > 0 then
      local start = at - (at % w)
      if c_cal[l_c[i]] then start = window_in(l_c[i], at) or -1 end
      if algo == 'f' then
        -- Only the decide's own window, and only a value in this version's form.
        local v = redis.call('GET', key)
        local c, s = string.match(v or '', '^(%d+)@(%d+)$')
        if c and tonumber(s) == start then
          redis.call('SET', key, f_value(max(tonumber(c) - hits, 0), start), 'KEEPTTL')
        end
      elseif algo == 's' then
        local s = tonumber(redis.call('HGET', key, 's') or '-1')
        local field = (s == start and 'c') or (s == start + w and 'p') or nil
        if field then
          local left = redis.call('HINCRBY', key, field, -hits)
          if left < 0 then redis.call('HSET', key, field, 0) end
        end
      elseif algo == 'w' then
        if redis.call('ZREM', key, member(i, hits)) == 1 then
          -- ZINCRBY replies with a string: compare it as a number.
          if tonumber(redis.call('ZINCRBY', key, hits, '#')) >= 0 then redis.call('ZREM', key, '#') end
        end
      elseif algo == 'b' then
        local tat = tonumber(redis.call('GET', key) or '0')
        if tat > now then
          local back = tat - hits * (w / rpu)
          if back > now then
            redis.call('SET', key, string.format('%.3f', back))
            expire_at_us(key, back + 1)
          else
            redis.call('DEL', key)
          end
        end
      end
    end
  end
end

-- Refunds and cost reports (see "Kinds" above), built on first use: rare next to admissions,
-- and under EVAL the whole file runs on every call, where each function it builds costs.
local accounting
local function build_accounting()
  -- Ends limit i's hold `id` and gives back at most l_back[i] of what it took, to the window
  -- (or the part of the bucket) it was charged to, nothing once that has passed (see
  -- State::refund_held in algorithm.rs). A concurrency limit: its place. A hold is found by
  -- its end, which names its window: fixed_window, the window's end; sliding_window, its
  -- window's start + 2 windows; sliding_log, its entry's time + a window; token_bucket, the
  -- arrival time its tokens took the bucket to.
  local function release(i, id)
    local c = l_c[i]
    local key, algo, rpu, w, hits = c_key[c], c_algo[c], c_rpu[c], c_w[c], l_back[i]
    -- A release owed to a refused replay of this id is consumed first, and ends nothing: a
    -- refused request's stream-done call never frees the hold it collided with.
    local hh = c_hh[c]
    if hh then
      local owed = tonumber(redis.call('HGET', hh, OWED .. id) or '')
      if owed then
        if owed > 1 then
          redis.call('HINCRBY', hh, OWED .. id, -1)
        else
          redis.call('HDEL', hh, OWED .. id)
        end
        return
      end
    end
    if algo == 'c' then
      local ends = tonumber(redis.call('ZSCORE', key, id) or '')
      if ends then
        redis.call('ZREM', key, id)
        if ends > now then
          l_delta[i], l_end[i] = -1, ends
        else
          l_ended[i] = l_ended[i] + 1
        end
      end
      return
    end
    local hk = c_hk[c]
    if not hk then return end
    local ends = tonumber(redis.call('ZSCORE', hk, id) or '')
    local took = tonumber(redis.call('HGET', hh, id) or '')
    if not ends then return end
    local taken_at = tonumber(redis.call('HGET', hh, TAKEN_AT .. id) or '')
    redis.call('ZREM', hk, id)
    redis.call('HDEL', hh, id, TAKEN_AT .. id)
    if ends <= now or not took then return end
    local back = min(hits, took)
    local start = c_start[c]
    if algo == 'f' then
      local st = cache[key] or cached(key, load_f, w)
      roll_f(st, start)
      if ends == start + w and st.count > 0 then
        st.count, st.dirty, st.w = max(st.count - back, 0), true, w
      end
    elseif algo == 's' then
      local st = cache[key] or cached(key, load_s, w)
      roll_s(st, start, w)
      local taken_in = ends - 2 * w
      if taken_in == start then
        st.c, st.rewrite, st.w = max(st.c - back, 0), true, w
      elseif taken_in == start - w then
        st.p, st.rewrite, st.w = max(st.p - back, 0), true, w
      end
    elseif algo == 'w' then
      -- Its own entry, scored when it was taken (with any other request's of that instant).
      local total = log_total(key, now - w)
      if total <= 0 then return end
      local at = taken_at or ends - w
      local mine = redis.call('ZRANGEBYSCORE', key, at, at, 'LIMIT', 0, LOG_REFUND_MAX)
      local rest, gone, shortened = back, {}, {}
      for _, m in ipairs(mine) do
        if rest <= 0 then break end
        local weight = tonumber(string.match(m, ':(%d+)$'))
        gone[#gone + 1] = m
        if weight <= rest then
          rest = rest - weight
        else
          shortened[#shortened + 1] = string.match(m, '^(.*):%d+$') .. ':' .. (weight - rest)
          rest = 0
        end
      end
      if #gone > 0 then redis.call('ZREM', key, unpack(gone)) end
      for _, m in ipairs(shortened) do redis.call('ZADD', key, at, m) end
      set_log_total(key, total - (back - rest))
    elseif algo == 'b' and rpu > 0 then
      local st = cache[key] or cached(key, load_b, w)
      local interval = w / rpu
      -- Its tokens refill by its end: what is still to refill of them is what it can give back.
      local back_t = min(back * interval, ends - now)
      if back_t > 0 and st.tat > now then
        st.tat, st.dirty = max(st.tat - back_t, now), true
      end
    end
  end

  -- Gives limit i's hits back (a refund), before anything of the request is checked: never below
  -- an empty counter (see State::refund in algorithm.rs).
  local function give_back(i)
    local c = l_c[i]
    local key, algo, rpu, w, hits = c_key[c], c_algo[c], c_rpu[c], c_w[c], l_back[i]
    if hits <= 0 then return end
    local hold = l_hold[i]
    -- On a node that keeps holds, only a refund naming one gives anything back.
    if hold == 'u' then return end
    if hold then return release(i, hold) end
    local start = c_start[c]
    if algo == 'f' then
      local st = cache[key] or cached(key, load_f, w)
      roll_f(st, start)
      if st.count > 0 then
        st.count, st.dirty, st.w = max(st.count - hits, 0), true, w
      end
    elseif algo == 's' then
      local st = cache[key] or cached(key, load_s, w)
      roll_s(st, start, w)
      -- The previous window first: a refund does not say when its hits were taken, and these
      -- weigh only their faded share (see State::refund).
      local from_p = min(hits, st.p)
      local from_c = min(hits - from_p, st.c)
      if from_c + from_p > 0 then
        st.c, st.p, st.rewrite, st.w = st.c - from_c, st.p - from_p, true, w
      end
    elseif algo == 'w' then
      -- The oldest weight first (see State::refund): remove whole members, shorten the last
      -- one. (`#` is scored below every entry's time, so it is never among them.)
      local total = log_total(key, now - w)
      if total <= 0 then return end
      local oldest = redis.call('ZRANGEBYSCORE', key, string.format('(%d', now - w), '+inf',
        'WITHSCORES', 'LIMIT', 0, LOG_REFUND_MAX)
      -- One ZREM for every member taken (a call per member let a request of many refunds on
      -- long logs hold Redis for a long time); the member shortened is written anew.
      local rest, gone, shortened = hits, {}, nil
      for j = 1, #oldest, 2 do
        local m = oldest[j]
        local weight = tonumber(string.match(m, ':(%d+)$'))
        gone[#gone + 1] = m
        if weight <= rest then
          rest = rest - weight
        else
          shortened = {oldest[j + 1], string.match(m, '^(.*):%d+$') .. ':' .. (weight - rest)}
          rest = 0
        end
        if rest <= 0 then break end
      end
      if #gone > 0 then redis.call('ZREM', key, unpack(gone)) end
      if shortened then redis.call('ZADD', key, shortened[1], shortened[2]) end
      set_log_total(key, total - (hits - rest))
    elseif algo == 'b' then
      if rpu > 0 then
        local st = cache[key] or cached(key, load_b, w)
        if st.tat > now then
          st.tat, st.dirty = max(st.tat - hits * (w / rpu), now), true
        end
      end
    end
  end

  -- Records limit i's cost report, fitting or not, up to D limits' worth past the limit (see
  -- State::record in algorithm.rs). The check has read its state into state[i].
  local function record(i)
    local c = l_c[i]
    local key, algo, rpu, w, burst, hits = c_key[c], c_algo[c], c_rpu[c], c_w[c], c_burst[c], l_hits[i]
    local ceiling = rpu * (debt + 1)
    local st = state[i]
    if algo == 'f' then
      local add = min(hits, max(ceiling - st.count, 0))
      if add > 0 then st.count, st.dirty, st.w = st.count + add, true, w end
    elseif algo == 's' then
      local used = ceil(st.p * (w - (now - st.s)) / w) + st.c
      local add = min(hits, max(ceiling - used, 0))
      if add > 0 then st.c, st.delta, st.w = st.c + add, st.delta + add, w end
    elseif algo == 'w' then
      local add = min(hits, max(ceiling - st, 0)) -- state[i]: the log's total
      if add > 0 then
        redis.call('ZADD', key, now, member(i, add))
        redis.call('ZINCRBY', key, -add, '#')
        expire_at_us(key, now + w + 1)
      end
    elseif algo == 'b' and rpu > 0 then
      local interval = w / rpu
      local base = max(st.tat, now)
      st.tat = max(base, min(base + hits * interval, now + burst * interval + debt * w))
      st.dirty = true
    end
  end

  -- Reads limit i's counter (into the call's cache; a sliding_log's type is checked), so that a
  -- request whose counters hold foreign data fails before it changes any of them.
  local function preload(i)
    local c = l_c[i]
    local key, algo = c_key[c], c_algo[c]
    if c_hk[c] then
      redis.call('ZCARD', c_hk[c])
      redis.call('HLEN', c_hh[c])
    end
    if algo == 'c' then
      redis.call('ZCARD', key)
      return
    end
    if cache[key] then return end
    if algo == 'f' then
      cached(key, load_f, c_w[c])
    elseif algo == 's' then
      cached(key, load_s, c_w[c])
    elseif algo == 'b' and c_rpu[c] > 0 then
      cached(key, load_b, c_w[c])
    elseif algo == 'w' then
      redis.call('ZSCORE', key, '#')
    end
  end

  return {give_back = give_back, record = record, preload = preload}
end

-- Holds (see "Holds" in the header), built on first use as `accounting` is: a request that names
-- none never runs them.
local holding
local function build_holding()
  -- The most holds one counter keeps (MAX_HOLDS in hold.rs): past it a rate limit's hold that
  -- ends first is dropped (its hits stay counted); a concurrency limit has no more places.
  local MAX_HOLDS = 10000

  -- Takes limit i's hold `id` for what its admission just took (see "Holds" in the header).
  local function take_hold(i, id)
    local c = l_c[i]
    local key, algo, w = c_key[c], l_algo[i], c_w[c]
    -- A release still owed under this id belongs to a hold that has ended (a live one refuses
    -- the id): it must not swallow this hold's release.
    if c_hh[c] then redis.call('HDEL', c_hh[c], OWED .. id) end
    if algo == 'c' then
      redis.call('ZADD', key, now + w, id)
      out[l_out[i]], out[l_out[i] + 1] = out[l_out[i]] + 1, now + w
      -- Kept a lifetime past its last place's end, so that a request then still finds (and
      -- counts) places that ended unreleased. Never shortened: a place taken after a reload
      -- shortened the lifetime leaves those taken before it their own (a key names no lifetime).
      local at, ttl = expiry_ms(now + 2 * w), redis.call('PTTL', key)
      if ttl < 0 or floor(now / 1000) + ttl < at then redis.call('PEXPIREAT', key, at) end
      return
    end
    local hk, hh = c_hk[c], c_hh[c]
    if not hk then return end
    local start, ends = c_start[c], 0
    if algo == 'f' then
      ends = start + w
    elseif algo == 's' then
      ends = start + 2 * w
    elseif algo == 'w' then
      ends = now + w
    else
      ends = next_tat[i]
    end
    redis.call('ZADD', hk, ends, id)
    if algo == 'w' then
      redis.call('HSET', hh, id, l_hits[i], TAKEN_AT .. id, now)
    else
      redis.call('HSET', hh, id, l_hits[i])
    end
    -- Ended holds leave (a bounded number per call), and past MAX_HOLDS the first to end.
    local ended = redis.call('ZRANGEBYSCORE', hk, '-inf', now, 'LIMIT', 0, 100)
    if #ended > 0 then
      redis.call('ZREM', hk, unpack(ended))
      redis.call('HDEL', hh, unpack(ended))
      local fields = {}
      for k = 1, #ended do
        fields[2 * k - 1], fields[2 * k] = OWED .. ended[k], TAKEN_AT .. ended[k]
      end
      redis.call('HDEL', hh, unpack(fields))
    end
    if redis.call('ZCARD', hk) > MAX_HOLDS then
      local oldest = redis.call('ZPOPMIN', hk)
      redis.call('HDEL', hh, oldest[1], TAKEN_AT .. oldest[1])
    end
    local last = redis.call('ZRANGE', hk, -1, -1, 'WITHSCORES')
    local at = tonumber(last[2]) + 1
    expire_at_us(hk, at)
    expire_at_us(hh, at)
  end

  -- A hold already held is refused (a replayed id): what a refund can give back stays what one
  -- admission took. Run after the request's limits are checked, for a request that names a hold:
  -- each limit whose hold is live is made over (its room 0, its reset when that hold ends), in
  -- its reply values from `first` on, and the request's verdict is taken again from every
  -- limit's, as `decide` takes it. Returns whether the request is admitted.
  local function settle_holds(first, admitted)
    local at, replayed = first, false
    for i = 1, n do
      local hold = l_hold[i]
      if hold and hold ~= 'u' and l_hits[i] > 0 and l_kind[i] == 'a' then
        local c = l_c[i]
        local by_end = c_key[c]
        if l_algo[i] ~= 'c' then by_end = c_hk[c] end
        local ends = tonumber(redis.call('ZSCORE', by_end, hold) or '')
        if ends and ends > now then
          over[i], out[at + 1], out[at + 2], replayed = true, -1, ends - now, true
          -- The refused request's own release will come: it is owed to this hold, kept no
          -- longer than the hold (a second past its end, as the hold keys are).
          local hh = c_hh[c]
          if redis.call('HINCRBY', hh, OWED .. hold, 1) > 4294967295 then
            redis.call('HSET', hh, OWED .. hold, 4294967295)
          end
          local ttl = redis.call('PTTL', hh)
          if ttl < 0 or now / 1000 + ttl < ends / 1000 + 1000 then expire_at_us(hh, ends + 1000000) end
        end
      end
      if l_algo[i] == 'c' then at = at + 4 else at = at + 2 end
    end
    if not replayed then return admitted end
    -- As decide's loop takes it (inline there: a call per limit would show in every call).
    local quota_seen, quota_all_over = false, true
    admitted = true
    for i = 1, n do
      local enforcement = l_enf[i]
      if over[i] then
        if enforcement == 'E' then
          admitted = false
        elseif enforcement == 'Q' then
          quota_seen = true
        end
      elseif enforcement == 'Q' then
        quota_seen, quota_all_over = true, false
      end
    end
    return admitted and not (quota_seen and quota_all_over)
  end

  return {settle = settle_holds, take = take_hold}
end

-- Decides the current request and appends its reply to `out`.
local function decide()
  -- Refunds first: they happened, and the request's other limits see what they freed. Every
  -- counter is read before the first refund changes one (see decide_entry).
  if refunds then
    -- (A request of one limit has nothing a refund could change before its own read fails.)
    if n > 1 then
      for i = 1, n do accounting.preload(i) end
    end
    for i = 1, n do
      if l_kind[i] == 'n' then accounting.give_back(i) end
    end
  end
  -- Check every limit (reads only; pruning the log changes no count). A refund's verdict is its
  -- counter as the refund left it (its hits are 0 here). A check of 0 hits asks whether one more
  -- unit fits: judged as 1 hit (`need`), what is left counted as for 0. (Checked apart, after
  -- the common case: a Lua operation per limit shows in what a call costs.) Each limit's room
  -- and reset go straight into the reply, and its verdict into the request's: all-or-nothing,
  -- an enforced limit over, or every quota limit over, rejects the request (a refund's
  -- enforcement is S: it never rejects). The request's first value, admitted, is written last.
  -- The tables read for every limit, as locals: an upvalue costs the interpreter an operation
  -- each time it is read.
  local out, over, state, l_algo, l_hits, c_st = out, over, state, l_algo, l_hits, c_st
  local reports = reports
  local first = out_n + 1
  local at = first
  local admitted, quota_seen, quota_all_over = true, false, true
  for i = 1, n do
    local c = l_c[i]
    local algo, rpu, w, hits = l_algo[i], c_rpu[c], c_w[c], l_hits[i]
    local start = c_start[c]
    local o, rem, rst = true, 0, w
    if algo == 'f' then
      local st = c_st[c]
      if not st then
        local key = c_key[c]
        st = cache[key] or cached(key, load_f, w)
        c_st[c] = st
      end
      state[i] = st
      if st.start ~= start then roll_f(st, start) end
      local after = st.count + hits
      o = rpu == 0 or after > rpu or (hits == 0 and after == rpu)
      if not o then rem = rpu - after else rem = max(rpu - st.count, 0) end
      rst = start + w - now
    elseif algo == 's' then
      local st = c_st[c]
      if not st then
        local key = c_key[c]
        st = cache[key] or cached(key, load_s, w)
        c_st[c] = st
      end
      state[i] = st
      if st.s ~= start then roll_s(st, start, w) end
      local p, c = st.p, st.c
      local e = now - start
      local faded = p * (w - e) -- the previous window's weight, times w
      local room = rpu - c - hits
      o = rpu == 0 or faded > room * w or (hits == 0 and faded > (room - 1) * w)
      if o then rem = max(rpu - c - ceil(faded / w), 0) end
      if not o then
        rem = room - ceil(faded / w)
        if c + hits > 0 then rst = 2 * w - e elseif p > 0 then rst = w - e else rst = 0 end
      elseif rpu > 0 and hits <= rpu then
        local r = rpu - hits
        if hits == 0 then r = rpu - 1 end
        if c <= r then
          rst = max(1, (w - floor((r - c) * w / max(p, 1))) - e)
        else
          rst = (w - e) + (w - floor(r * w / c))
        end
      end
    elseif algo == 'w' then
      local key = c_key[c]
      local count = log_total(key, now - w)
      state[i] = count
      local after = count + hits
      o = rpu == 0 or after > rpu or (hits == 0 and after == rpu)
      if o then rem = max(rpu - count, 0) end
      if not o then
        rem = rpu - after
        if hits > 0 then
          rst = w
        else
          local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
          if newest[2] and tonumber(newest[2]) > 0 then
            rst = tonumber(newest[2]) + w - now
          else
            rst = 0
          end
        end
      elseif rpu > 0 and hits <= rpu then
        rst = log_wait(key, max(after, count + 1) - rpu, w)
      end
    elseif algo == 'b' then
      if rpu > 0 then
        local interval = w / rpu
        local cap = c_burst[c] * interval
        local st = c_st[c]
        if not st then
          local key = c_key[c]
          st = cache[key] or cached(key, load_b, w)
          c_st[c] = st
        end
        state[i] = st
        local tat = max(st.tat, now)
        local need = hits
        if hits == 0 then need = 1 end
        local new_tat = tat + hits * interval
        o = tat + need * interval - now > cap + 0.001
        if not o then
          rem = floor((cap - (new_tat - now)) / interval + 0.000001)
          rst = ceil(new_tat - now - 0.001)
          next_tat[i] = new_tat
        else
          rem = max(floor((cap - (tat - now)) / interval + 0.000001), 0)
          if need <= c_burst[c] then rst = ceil(tat + need * interval - now - cap - 0.001) end
        end
      end
    elseif algo == 'c' then
      -- Places: one per live hold, whatever the hits (a request in flight is one). Ended
      -- holds leave first. A refund's verdict is the places as it left them, never over (its
      -- reset 0: the request it ends is done).
      local key = c_key[c]
      local refund = l_kind[i] == 'n'
      if not refund then
        l_ended[i] = l_ended[i] + redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
      end
      local used = redis.call('ZCARD', key)
      local take = 0
      if hits > 0 then take = 1 end
      o = not refund and (rpu == 0 or used + 1 > rpu)
      if refund then
        rem, rst = max(rpu - used, 0), 0
      elseif not o then
        rem = rpu - used - take
        if take == 1 then
          rst = w
        else
          local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
          if last[2] then rst = tonumber(last[2]) - now else rst = 0 end
        end
      else
        -- The first place to free itself is the hold that ends first.
        local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
        if first[2] then rst = tonumber(first[2]) - now end
      end
    else
      error('ratelimitd: unknown algorithm ' .. tostring(algo))
    end
    over[i] = o
    if rem < 0 then rem = 0 end
    local enforcement = l_enf[i]
    if o then
      rem = -1 - rem
      if enforcement == 'E' then
        admitted = false
      elseif enforcement == 'Q' then
        quota_seen = true
      end
    elseif enforcement == 'Q' then
      quota_seen, quota_all_over = true, false
    end
    out[at + 1], out[at + 2] = rem, rst
    if algo == 'c' then
      out[at + 3], out[at + 4], l_out[i] = 2 + l_delta[i] + 4 * l_ended[i], l_end[i], at + 3
      at = at + 4
    else
      at = at + 2
    end
  end
  if quota_seen and quota_all_over then admitted = false end
  if named then admitted = holding.settle(first, admitted) end
  out[first] = admitted and 1 or 0
  out_n = at

  -- Admissions are consumed only if the request is admitted; reports are recorded anyway
  -- (a refund's hits are 0 here: it is given back already).
  if admitted then
    for i = 1, n do
      local hits = l_hits[i]
      if not over[i] and hits > 0 then
        if reports and l_kind[i] == 'r' then
          accounting.record(i)
        else
          local algo, st = l_algo[i], state[i]
          if algo == 'f' then
            st.count, st.dirty = st.count + hits, true
          elseif algo == 's' then
            st.c, st.delta = st.c + hits, st.delta + hits
          elseif algo == 'w' then
            local c = l_c[i]
            local key, w = c_key[c], c_w[c]
            redis.call('ZADD', key, now, member(i, hits))
            redis.call('ZINCRBY', key, -hits, '#')
            expire_at_us(key, now + w + 1)
          elseif algo == 'b' then
            st.tat, st.dirty = next_tat[i], true
          end
        end
      elseif reports and hits > 0 and l_kind[i] == 'r' then
        accounting.record(i)
      end
    end
    if named then
      for i = 1, n do
        local hold = l_hold[i]
        if hold and hold ~= 'u' and not over[i] and l_hits[i] > 0 and l_kind[i] == 'a' then
          holding.take(i, hold)
        end
      end
    end
  elseif reports then
    for i = 1, n do
      if l_kind[i] == 'r' and l_hits[i] > 0 then accounting.record(i) end
    end
  end
end

-- Errors that mean Redis cannot serve now: they fail the whole call (see the header).
local UNAVAILABLE = {'OOM', 'NOREPLICAS', 'MISCONF', 'READONLY', 'LOADING', 'MASTERDOWN', 'BUSY'}

-- The current entry's m requests, one after another.
local function decide_run(m)
  for _ = 1, m do decide() end
end

-- Answers the current entry's m requests `admitted` (-1: foreign data; -2: a calendar window
-- the boundaries miss) and zeros: nothing was decided for them.
local function undecided(m, admitted)
  local o = out_n
  for _ = 1, m do
    out[o + 1] = admitted
    o = o + 1
    for i = 1, n do
      out[o + 1], out[o + 2] = 0, 0
      o = o + 2
      if l_algo[i] == 'c' then
        out[o + 1], out[o + 2] = 0, 0
        o = o + 2
      end
    end
  end
  out_n = o
end

-- Decides the current entry on its own: if its counters hold foreign data, each of its requests
-- gets admitted = -1 and zeros, and it leaves no trace; the call's other entries go on. (Only
-- loading a counter can find foreign data, and an entry's requests share their counters, so
-- the first of them is the one that fails.)
local function decide_entry(m)
  local o = out_n
  local ok, err = pcall(decide_run, m)
  if ok then return end
  -- Redis 7 raises a table {err = ...}; earlier versions a string with the position first.
  local msg = type(err) == 'table' and err.err or tostring(err)
  for _, code in ipairs(UNAVAILABLE) do
    if string.find(msg, code .. ' ', 1, true) then error(err) end
  end
  out_n = o
  undecided(m, -1)
end

-- Values 1..n of `values` as one string of little-endian doubles. `unpack` puts what it
-- returns on Lua's C stack, which holds 8,000 at most: a larger reply is packed in slices.
local PACK_SLICE = 2048
local function packed(values, n)
  if n <= PACK_SLICE then
    return pack_numbers('<' .. string.rep('d', n), unpack_values(values, 1, n))
  end
  local slices = {}
  for i = 1, n, PACK_SLICE do
    local j = min(i + PACK_SLICE - 1, n)
    local format = '<' .. string.rep('d', j - i + 1)
    slices[#slices + 1] = pack_numbers(format, unpack_values(values, i, j))
  end
  return table.concat(slices)
end

-- One call: everything above is built once per library load (FCALL), or once per call (EVAL).
local function main(KEYS, ARGV)
  if not floor then
    floor, ceil, max, min = math.floor, math.ceil, math.max, math.min
    unpack_numbers, pack_numbers, unpack_values = struct.unpack, struct.pack, unpack
  end
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local mode = ARGV[1]
  out[1], out_n = now, 1
  for i = 1, order_n do cache[order[i]] = nil end
  order_n = 0
  -- The numbers, read in order from ARGV[2]; the nonces, in order from ARGV[3].
  local blob, at_byte, next_nonce = ARGV[2], 1, 3
  local entries, counters
  entries, counters, debt, at_byte = unpack_numbers('<ddd', blob, at_byte)
  local stale_any = false
  for c = 1, counters do
    local k, a
    k, a, c_rpu[c], c_w[c], c_burst[c], at_byte = unpack_numbers('<ddddd', blob, at_byte)
    c_key[c], c_st[c] = KEYS[k], false
    if a > 10 then
      local hk
      hk, at_byte = unpack_numbers('<d', blob, at_byte)
      c_hk[c], c_hh[c], a = KEYS[hk], KEYS[hk + 1], a - 10
    else
      c_hk[c] = false
    end
    if a == 5 then
      c_b0[c], c_b1[c], c_b2[c], c_b3[c], at_byte = unpack_numbers('<dddd', blob, at_byte)
      c_algo[c], c_cal[c] = 'f', true
      local start, w = window_in(c, now)
      if start then
        c_start[c], c_w[c], c_stale[c] = start, w, false
      else
        c_start[c], c_stale[c], stale_any = now - (now % c_w[c]), true, true
      end
    else
      c_algo[c], c_start[c], c_cal[c], c_stale[c] = ALGORITHMS[a], now - (now % c_w[c]), false, false
    end
  end
  local undoing = mode == 'undo'
  for _ = 1, entries do
    local m, at, marker = 1, 0, 0
    if undoing then
      at, marker, n, at_byte = unpack_numbers('<ddd', blob, at_byte)
      nonce, next_nonce = ARGV[next_nonce], next_nonce + 1
    else
      m, n, at_byte = unpack_numbers('<dd', blob, at_byte)
    end
    local logged, stale = false, false
    refunds, reports, named = false, false, false
    for i = 1, n do
      local c, hits, e
      c, hits, e, at_byte = unpack_numbers('<ddd', blob, at_byte)
      -- Holds: 10-18 names one (its id follows in ARGV), 19-27 keeps them and names none.
      if e <= 9 then
        l_hold[i] = false
      elseif e > 18 then
        e, l_hold[i] = e - 18, 'u'
      else
        e, l_hold[i], named = e - 9, true, true
      end
      -- Kinds: a (admission), r (cost report), n (refund: its hits go to l_back; as to the
      -- request's admission it is a shadow limit, which never rejects).
      if e <= 3 then
        l_c[i], l_hits[i], l_enf[i], l_kind[i] = c, hits, ENFORCEMENTS[e], 'a'
      elseif e <= 6 then
        l_c[i], l_hits[i], l_enf[i], l_kind[i], reports = c, hits, ENFORCEMENTS[e - 3], 'r', true
      else
        l_c[i], l_hits[i], l_enf[i], l_kind[i], l_back[i], refunds = c, 0, 'S', 'n', hits, true
      end
      local algo = c_algo[c]
      l_algo[i] = algo
      if algo == 'w' then
        logged = true
      elseif algo == 'c' then
        l_delta[i], l_end[i], l_ended[i] = 0, 0, 0
      end
      if stale_any and c_stale[c] then stale = true end
    end
    if (refunds or reports) and not accounting then accounting = build_accounting() end
    if named and not holding then holding = build_holding() end
    if not undoing and logged then
      nonce, next_nonce = ARGV[next_nonce], next_nonce + 1
    end
    -- The holds named, in the limits' order, after the entry's nonce.
    if named then
      for i = 1, n do
        if l_hold[i] == true then
          l_hold[i], next_nonce = ARGV[next_nonce], next_nonce + 1
        end
      end
    end
    if undoing then
      -- The marker outlives any retry of this call (the client's budget is seconds at most).
      if redis.call('SET', KEYS[marker], '1', 'NX', 'PX', 60000) then undo(at) end
      out[out_n + 1] = 1
      out_n = out_n + 1
    else
      if stale then
        -- A calendar window the boundaries miss: the client asks again (see the header).
        undecided(m, -2)
      else
        decide_entry(m)
      end
    end
  end
  flush()
  return packed(out, out_n)
end

-- Loaded as a function library (FUNCTION LOAD), `FUNCTION` is the name the loader's header
-- declares; run by EVAL or EVALSHA, this is the call itself.
if redis.register_function then
  redis.register_function(FUNCTION, main)
else
  return main(KEYS, ARGV)
end
