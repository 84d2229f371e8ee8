-- XACK of those of the ids ARGV[5..] the consumer ARGV[2] still holds: an entry a peer claimed stays the peer's to
-- end. One XPENDING of the consumer's entries between the lowest and the highest id (ARGV[3], ARGV[4]) tells which,
-- rather than one per id. A stream or group Redis lost holds nothing pending: nothing to acknowledge (an error
-- would only stall the caller's pipeline).
local pending = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[4], 2147483647, ARGV[2])
if type(pending) ~= 'table' or pending.err then return 0 end
local held = {}
for _, p in ipairs(pending) do held[p[1]] = true end
local mine = {'XACK', KEYS[1], ARGV[1]}
for i = 5, #ARGV do
  if held[ARGV[i]] then table.insert(mine, ARGV[i]) end
end
if #mine == 3 then return 0 end
return redis.call(unpack(mine))
