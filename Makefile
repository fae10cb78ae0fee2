# The two commands that matter: `make run` and `make test`. See README.md.
CARGO ?= cargo
EXAMPLE_LIMITS ?= examples/envoy/limits

.PHONY: run test lint deps build bench envoy-bench day-two rlqs-restart pools worst fuzz soak

## Build and start ratelimitd on the embedded memory backend with the example limits.
run:
	$(CARGO) run --release -- --config $(EXAMPLE_LIMITS) --log-level info

## The whole suite: installs what the tests need, then lint and every test; then the suites
## that start Redis again on Valkey, where valkey-server is installed (.ci/run installs it).
REDIS_SUITES = accounting admin binary calendar cluster differential grpc holds isolation redis refunds reload reservations rlqs top tracing values xds
test: deps lint
	RATELIMITD_REQUIRE_FIXTURES=$${RATELIMITD_REQUIRE_FIXTURES-} RATELIMITD_REQUIRE_HELM=1 RATELIMITD_REQUIRE_GRPCIO=1 RATELIMITD_REQUIRE_ENVOY=1 $(CARGO) test
	@if command -v valkey-server >/dev/null 2>&1; then \
	  echo "test: the Redis suites again, on $$(valkey-server --version | cut -d' ' -f1-3)"; \
	  RATELIMITD_TEST_REDIS_SERVER=valkey-server $(CARGO) test $(foreach t,$(REDIS_SUITES),--test $(t)); \
	else \
	  echo "test: valkey-server is not installed, so the Redis suites ran on Redis only (.ci/run installs Valkey)"; \
	fi

## fmt --check, clippy and rustdoc, each with warnings as errors, and the structure
## (tests/layers.rs: every import runs down a floor, the protocol at the edge, one name one type).
lint:
	$(CARGO) fmt --check
	$(CARGO) clippy --all-targets -- -D warnings
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --no-deps --quiet
	$(CARGO) test --quiet --test layers

## Tools the tests use (redis-server arrives with the Redis backend's tests).
deps:
	@./scripts/deps.sh

build:
	$(CARGO) build --release

## Throughput and latency under load (release build, loopback only; not part of `make test`).
bench:
	./scripts/bench.sh

## Load through a real Envoy (examples/envoy/envoy.yaml, its 20 ms timeout): the RLS latency
## Envoy observes and the calls it let through, memory and Redis; not in CI.
envoy-bench:
	./scripts/envoy-bench.sh

## Day two through Envoy (examples/envoy/envoy.yaml, its 20 ms timeout) behind a Service
## stand-in: a rolling update, a SIGKILLed replica and a fresh replica's first burst, at
## 1,000 requests a second: calls failed open and requests admitted against the budget; not in CI.
day-two:
	./scripts/day-two.sh

## A rolling restart on the quota path (examples/envoy/rlqs.yaml): what the Envoy that replaces
## a killed one admits from its first request, memory and Redis; not in CI.
rlqs-restart:
	./scripts/rlqs-restart.sh

## A large RLQS pool beside RLS traffic, memory and Redis (release build, loopback); not in CI.
pools:
	./scripts/pools.sh

## What answers cost: the request path with none configured against OLD (a release binary of
## the main before them), and a rendered 429 with --default-answer; not in CI.
answer-cost:
	./scripts/answer-cost.sh $(OLD)

## What the costliest accepted request costs, and what a victim sees beside it; not in CI.
worst:
	./scripts/worst.sh

## Coverage-guided fuzzing (AFL++ via cargo-afl, stable Rust), FUZZ_SECONDS per target; not in CI.
fuzz:
	./scripts/fuzz.sh

## 10 minutes of mixed load at half of peak with Redis restarts and config reloads; not in CI.
soak:
	./scripts/soak.sh
