-- XACK of those of the ids the consumer still holds: an entry a peer claimed stays the peer's to end. A stream or
-- group Redis lost holds nothing pending: nothing to acknowledge (an error would only stall the caller's pipeline).
-- One XPENDING of the consumer's entries between the lowest and the highest id tells which it holds (as in
-- touch_own.lua), rather than one per id.
local function before(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  am, bm = tonumber(am), tonumber(bm)
  return am < bm or (am == bm and tonumber(as) < tonumber(bs))
end
if #ARGV < 3 then return 0 end
local lo, hi = ARGV[3], ARGV[3]
for i = 4, #ARGV do
  if before(ARGV[i], lo) then lo = ARGV[i] end
  if before(hi, ARGV[i]) then hi = ARGV[i] end
end
local pending = redis.pcall('XPENDING', KEYS[1], ARGV[1], lo, hi, 2147483647, ARGV[2])
if type(pending) ~= 'table' or pending.err then return 0 end
local held = {}
for _, p in ipairs(pending) do held[p[1]] = true end
local mine = {'XACK', KEYS[1], ARGV[1]}
for i = 3, #ARGV do
  if held[ARGV[i]] then table.insert(mine, ARGV[i]) end
end
if #mine == 3 then return 0 end
return redis.call(unpack(mine))
