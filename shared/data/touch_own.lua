-- The entries among ARGV[5..] that the consumer ARGV[2] still holds get their idle time reset (one XCLAIM); the
-- others are returned: a peer claimed them. One XPENDING of the consumer's entries between the lowest and the
-- highest id asked about (ARGV[3], ARGV[4]) tells which, rather than one per id (a scheduler touches every entry
-- it runs).
local held = {}
for _, p in ipairs(redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[4], 2147483647, ARGV[2])) do
  held[p[1]] = true
end
local mine, lost = {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}, {}
for i = 5, #ARGV do
  if held[ARGV[i]] then table.insert(mine, ARGV[i]) else table.insert(lost, ARGV[i]) end
end
if #mine > 5 then
  table.insert(mine, 'JUSTID')
  redis.call(unpack(mine))
end
return lost
