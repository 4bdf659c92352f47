#!/usr/bin/env bash
# Make sure PostgreSQL and Redis run on 127.0.0.1 (the integration tests use them for real).
set -uo pipefail
if ! pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; then
  command -v pg_ctlcluster >/dev/null && pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start || true
fi
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  command -v redis-server >/dev/null && redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" \
    --appendonly no --dir /tmp --logfile /tmp/eagle3-redis.log || true
fi
for i in $(seq 1 20); do
  pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null && redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && exit 0
  sleep 0.5
done
echo "services.sh: PostgreSQL or Redis is not reachable on 127.0.0.1 (integration tests will fail)" >&2
