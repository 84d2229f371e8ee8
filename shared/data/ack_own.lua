-- XACK of those of the ids the consumer still holds: an entry a peer claimed stays the peer's to end. A stream or
-- group Redis lost holds nothing pending: nothing to acknowledge (an error would only stall the caller's pipeline).
local mine = {'XACK', KEYS[1], ARGV[1]}
for i = 3, #ARGV do
  local p = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then table.insert(mine, ARGV[i]) end
end
if #mine == 3 then return 0 end
return redis.call(unpack(mine))
