-- KEYS: a stream, a key that lives and dies with it, a set; ARGV: the group, the stream's member in the set.
local function after(a, b)
  local am, as = string.match(a, '(%d+)-(%d+)')
  local bm, bs = string.match(b, '(%d+)-(%d+)')
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am > bm or (am == bm and as > bs)
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)[1]
  if last then
    local delivered = nil
    for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
      local f = {}
      for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
      if f['name'] == ARGV[1] then
        if f['pending'] > 0 then return 0 end
        delivered = f['last-delivered-id']
      end
    end
    if not delivered or after(last[1], delivered) then return 0 end
  end
  redis.call('DEL', KEYS[1])
end
redis.call('DEL', KEYS[2])
redis.call('SREM', KEYS[3], ARGV[2])
return 1
