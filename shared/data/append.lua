-- One call appends one entry to each of many streams (and refreshes the TTLs asked for): a detokenizer's read
-- writes an entry to the reply stream of every request in it, and as separate pipelined XADDs the client's
-- command packing and reply parsing cost it more CPU than everything else it does per token.
local maxlen, ttl = ARGV[1], ARGV[2]
for i = 1, #KEYS do
  redis.call('XADD', KEYS[i], 'MAXLEN', '~', maxlen, '*', 'data', ARGV[1 + 2 * i])
  if ARGV[2 + 2 * i] == '1' then redis.call('EXPIRE', KEYS[i], ttl) end
end
return #KEYS
