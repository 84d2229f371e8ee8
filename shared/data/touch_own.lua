local mine, lost = {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}, {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then table.insert(mine, ARGV[i]) else table.insert(lost, ARGV[i]) end
end
if #mine > 5 then
  table.insert(mine, 'JUSTID')
  redis.call(unpack(mine))
end
return lost
