# fedlink's container images: two targets of one multi-stage build (see docs/deploying.md).
#   docker build --target coordinator -t fedlink-coordinator .   # fedlink serve (the server extra)
#   docker build --target runner -t fedlink-runner .             # fedlink runner (a plain install)
# Every dependency is pinned by deploy/constraints.txt, the file .ci/test and tests/deploy install from.
# Both final stages hold a venv and nothing else of the build: no compiler, no wheel cache, no pip.

ARG PYTHON_IMAGE=python:3.11-slim

# ---- the wheel, built from this checkout ---------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY deploy/constraints.txt /tmp/constraints.txt
RUN python -m pip install --no-cache-dir --disable-pip-version-check -c /tmp/constraints.txt build hatchling
COPY pyproject.toml README.md ./
COPY runner runner
COPY server server
COPY proto/gen/python proto/gen/python
# --no-isolation: the pinned hatchling above, not whatever the build frontend would fetch.
RUN python -m build --wheel --no-isolation --outdir /wheels .

# ---- the two installs, each a venv in /opt/fedlink -----------------------------------------------------
FROM ${PYTHON_IMAGE} AS runner-venv
COPY deploy/constraints.txt /tmp/constraints.txt
COPY --from=wheel /wheels /wheels
# The runner side: `pip install fedlink`, no server dependencies (tests/deploy runs this same step).
RUN python -m venv /opt/fedlink \
    && /opt/fedlink/bin/pip install --no-cache-dir --disable-pip-version-check \
        -c /tmp/constraints.txt /wheels/fedlink-*.whl \
    && /opt/fedlink/bin/pip uninstall --yes pip

FROM ${PYTHON_IMAGE} AS coordinator-venv
COPY deploy/constraints.txt /tmp/constraints.txt
COPY --from=wheel /wheels /wheels
# The coordinator: `pip install 'fedlink[server]'` (tests/deploy runs this same step).
RUN python -m venv /opt/fedlink \
    && wheel="$(echo /wheels/fedlink-*.whl)" \
    && /opt/fedlink/bin/pip install --no-cache-dir --disable-pip-version-check \
        -c /tmp/constraints.txt "${wheel}[server]" \
    && /opt/fedlink/bin/pip uninstall --yes pip

# ---- what both images share: a non-root user and its state directory -----------------------------------
FROM ${PYTHON_IMAGE} AS base
# A fixed uid/gid (10001): secret files mounted from the host must be readable by it (docs/deploying.md).
RUN groupadd --system --gid 10001 fedlink \
    && useradd --system --uid 10001 --gid fedlink --no-create-home --home-dir /var/lib/fedlink \
        --shell /usr/sbin/nologin fedlink \
    && install -d -o fedlink -g fedlink -m 0700 /var/lib/fedlink
ENV PATH=/opt/fedlink/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    FEDLINK_LOG_FORMAT=json
WORKDIR /var/lib/fedlink
USER 10001:10001
ENTRYPOINT ["fedlink"]

# ---- fedlink runner --------------------------------------------------------------------------------------
FROM base AS runner
COPY --from=runner-venv /opt/fedlink /opt/fedlink
# The device identity and unacknowledged results: keep this directory (a volume) across upgrades.
ENV FEDLINK_STATE_DIR=/var/lib/fedlink
VOLUME ["/var/lib/fedlink"]
# A runner serves nothing to probe: it exits 1 once the coordinator has been unreachable for
# connect_timeout, and the restart policy (compose `restart:`, a Deployment) starts it again.
HEALTHCHECK NONE
CMD ["runner"]

# ---- fedlink serve (the default target) ------------------------------------------------------------------
FROM base AS coordinator
COPY --from=coordinator-venv /opt/fedlink /opt/fedlink
# Everything the coordinator keeps without a database URL (SQLite, blobs, self-signed TLS, secrets).
ENV FEDLINK_DATA_DIR=/var/lib/fedlink \
    FEDLINK_LISTEN_ADDRESS=0.0.0.0:8443 \
    FEDLINK_METRICS_ADDRESS=0.0.0.0:9464 \
    FEDLINK_HEALTH_SERVER=127.0.0.1:8443 \
    FEDLINK_HEALTH_CA_CERT=/var/lib/fedlink/tls/ca.pem
VOLUME ["/var/lib/fedlink"]
EXPOSE 8443 9464
# gRPC health (grpc.health.v1) over TLS: exit 0 when SERVING, 1 otherwise (its own timeout inside Docker's).
# FEDLINK_HEALTH_CA_CERT: the CA of the server certificate, which must cover 127.0.0.1 (the self-signed
# one does, and so does deploy/make_secrets.py's).
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["sh", "-c", "exec fedlink health --timeout 3 --server \"$FEDLINK_HEALTH_SERVER\" --ca-cert \"$FEDLINK_HEALTH_CA_CERT\""]
# SIGTERM: NOT_SERVING, no new tasks, in-flight calls get shutdown_grace (10 s): give `docker stop` more.
STOPSIGNAL SIGTERM
CMD ["serve"]
