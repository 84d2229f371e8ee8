-- Reads the streams named in KEYS in order, up to ARGV[3] new entries in all: a scheduler's own stream before the
-- shared one, never more than its engine has room for. Streams whose group is missing are returned apart, for the
-- caller to recreate.
local got, missing, left = {}, {}, tonumber(ARGV[3])
for i = 1, #KEYS do
  if left <= 0 then break end
  local r = redis.pcall('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', left, 'STREAMS', KEYS[i], '>')
  if type(r) == 'table' and r.err then
    table.insert(missing, KEYS[i])
  elseif r then
    table.insert(got, r[1])
    left = left - #r[1][2]
  end
end
return {got, missing}
