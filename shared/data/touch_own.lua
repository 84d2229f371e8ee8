-- The entries among ARGV[3..] that the consumer ARGV[2] still holds get their idle time reset (one XCLAIM); the
-- others are returned: a peer claimed them. One XPENDING of the consumer's entries between the lowest and the
-- highest id asked about tells which, rather than one per id (a scheduler touches every entry it runs).
local function before(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  am, bm = tonumber(am), tonumber(bm)
  return am < bm or (am == bm and tonumber(as) < tonumber(bs))
end
if #ARGV < 3 then return {} end
local lo, hi = ARGV[3], ARGV[3]
for i = 4, #ARGV do
  if before(ARGV[i], lo) then lo = ARGV[i] end
  if before(hi, ARGV[i]) then hi = ARGV[i] end
end
local held = {}
for _, p in ipairs(redis.call('XPENDING', KEYS[1], ARGV[1], lo, hi, 2147483647, ARGV[2])) do held[p[1]] = true end
local mine, lost = {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}, {}
for i = 3, #ARGV do
  if held[ARGV[i]] then table.insert(mine, ARGV[i]) else table.insert(lost, ARGV[i]) end
end
if #mine > 5 then
  table.insert(mine, 'JUSTID')
  redis.call(unpack(mine))
end
return lost
