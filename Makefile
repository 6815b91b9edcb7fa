# eitri — the two commands that matter: `make run` and `make test`.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

GO      ?= go
CACHE   := $(CURDIR)/.cache
GUEST   := $(CACHE)/guest
DEBIAN  := $(CACHE)/debian
BIN     := $(CURDIR)/bin/eitri
BUF     := node_modules/.bin/buf
VERSION ?= $(shell git describe --always --dirty 2>/dev/null || echo dev)

# Debian packages the tests and dev mode use (jq for the README's quickstart): QEMU and the tools that build
# the test guest, socat for the proxy benchmark, chromium for the console's
# end-to-end test; mmdebstrap and e2fsprogs build the Debian cloud-style image,
# whose test logs in with the system ssh client; the SSH certificate tests
# run openssh-server's sshd on loopback; the store's tests run each on
# PostgreSQL too, in a throwaway server of their own (server/store/pgtest),
# never the cluster the package may start; haproxy checks and runs the load
# balancer config in deploy/haproxy; prometheus scrapes /metrics in
# server/metrics' test and its promtool checks the exposition.
APT_PKGS := qemu-system-x86 qemu-utils busybox-static syslinux syslinux-common \
	mtools dosfstools fdisk cpio kmod genisoimage iproute2 socat chromium curl jq \
	mmdebstrap e2fsprogs openssh-client openssh-server postgresql haproxy prometheus

.PHONY: help
help:
	@echo "make run        set up and start eitri in dev mode (control plane + local agent + console)"
	@echo "make test       install what the tests need and run every test"
	@echo "make generate   regenerate gen/ from proto/"
	@echo "make build      build bin/eitri (with the console when it is built)"

.PHONY: deps
deps: ## system packages (root), npm packages
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		if [ "$$(id -u)" != 0 ]; then echo "need root to apt-get install:$$missing" >&2; exit 1; fi; \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi
	@sum=$$(sha256sum package-lock.json | cut -d' ' -f1); \
	if [ "$$(cat node_modules/.eitri-lock 2>/dev/null)" != "$$sum" ]; then \
		npm ci --no-audit --no-fund --loglevel=error && echo "$$sum" > node_modules/.eitri-lock; fi

.PHONY: generate
generate: ## gen/ from proto/ (local plugins only)
	@[ -x $(BUF) ] || npm ci --no-audit --no-fund --loglevel=error
	$(BUF) generate

.PHONY: check-generated
check-generated: generate
	@if [ -n "$$(git status --porcelain -- gen)" ]; then \
		echo "gen/ is stale: run 'make generate' and commit the result" >&2; git status --short -- gen >&2; exit 1; fi

.PHONY: lint
lint:
	$(BUF) lint
	@if git rev-parse -q --verify main >/dev/null; then \
		$(BUF) breaking --against '.git#branch=main'; fi
	$(GO) vet ./...
	@out=$$(gofmt -l $$(git ls-files '*.go' | grep -v '^gen/')); if [ -n "$$out" ]; then echo "gofmt needed:" >&2; echo "$$out" >&2; exit 1; fi

.PHONY: guest-image
guest-image: ## the tiny test guest, cached by content hash
	guestimage/build.sh $(GUEST) >/dev/null

# issue 12: a Debian bookworm image with real cloud-init and OpenSSH, cached
# by content. Building it needs root (mmdebstrap's chroot); without root the
# test that boots it skips, so this only says so.
.PHONY: debian-image
debian-image:
	@if [ "$$(id -u)" = 0 ]; then guestimage/debian.sh $(DEBIAN) >/dev/null; \
	else echo "not building the Debian image: needs root (its test skips)"; fi

.PHONY: frontend
frontend:
	@if [ -f frontend/package.json ]; then npm run --workspace frontend build; fi

.PHONY: build
build: frontend
	@tags=""; [ -f frontend/build/index.html ] && tags="-tags console"; \
	$(GO) build $$tags -ldflags "-X main.version=$(VERSION)" -o $(BIN) ./cmd/eitri

.PHONY: run
run: deps guest-image build
	$(BIN) dev --guest-image $(GUEST)

.PHONY: test
test: deps check-generated lint guest-image debian-image build
	EITRI_GUEST_IMAGE=$(GUEST)/eitri-guest.raw EITRI_DEBIAN_IMAGE=$(DEBIAN)/eitri-debian.raw EITRI_BIN=$(BIN) $(GO) test -count=1 -timeout 30m ./...
	@if [ -f frontend/package.json ]; then npm run --workspace frontend check && npm run --workspace frontend test; fi
	EITRI_BIN=$(BIN) npm run --workspace gen/ts test
	@if [ -f frontend/e2e/run.mjs ]; then EITRI_BIN=$(BIN) EITRI_GUEST=$(GUEST) node frontend/e2e/run.mjs; fi

.PHONY: bench
bench:
	$(GO) test -run '^$$' -bench . -benchtime 3x ./...

# issue 13: 200 simulated agents, 1,000 watchers, against a real control plane.
.PHONY: bench-scale
bench-scale:
	$(GO) build -o $(BIN) ./cmd/eitri
	$(GO) run ./bench/scale -bin $(BIN) -hosts $${HOSTS:-200} -vms $${VMS:-20} -watchers $${WATCHERS:-1000} -for $${FOR:-20s}

# One replica on SQLite, then REPLICAS replicas on one throwaway PostgreSQL
# (Debian's postgresql package), same load, side by side (issue 23).
.PHONY: bench-scale-replicas
bench-scale-replicas:
	$(GO) build -o $(BIN) ./cmd/eitri
	$(GO) run ./bench/scale -bin $(BIN) -compare -db postgres -replicas $${REPLICAS:-3} -hosts $${HOSTS:-200} -vms $${VMS:-20} -watchers $${WATCHERS:-300} -for $${FOR:-20s} -floor=false

# issue 37: two builds' hot paths alternately in one run, with ratios:
# make bench-compare BASE=<commit> (default HEAD, i.e. the work tree's change).
.PHONY: bench-compare
bench-compare:
	BASE="$(or $(BASE),HEAD)" bench/compare/compare.sh
