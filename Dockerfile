# attnserve container: built with the project's own scripts, run slim and
# non-root. No Docker engine runs in CI, so CI runs the same steps instead:
# deploy/install_deps.sh and deploy/build.sh build, `cmake --install` installs,
# deploy/check_runtime_deps.sh proves the runtime stage's package list, and
# deploy/lint_dockerfile.py checks this file and .dockerignore.
#
#   docker build --build-arg VERSION="$(deploy/version.sh)" \
#     --build-arg REVISION="$(git rev-parse --short=12 HEAD)" -t attnserve:"$(deploy/version.sh)" .
#   docker run --rm -p 50051:50051 -p 9464:9464 attnserve:"$(deploy/version.sh)"
#
# VERSION and REVISION only label the image (org.opencontainers.image.*) and
# give the binaries their git revision (the build context has no .git); the
# version the binaries report comes from CMakeLists.txt.
#
# Ports: 50051 gRPC (--listen_address), 9464 Prometheus metrics at /metrics
# (--metrics_address). The model repository goes at /models, read-only
# (deploy/compose, deploy/k8s), for when the server reads model repositories.

# --- build: Debian's toolchain and -dev packages, a Release build, installed
# under /opt/attnserve.
FROM debian:12 AS build
ARG REVISION=""
WORKDIR /src
COPY deploy/install_deps.sh deploy/
RUN deploy/install_deps.sh --build && rm -rf /var/lib/apt/lists/*
COPY . .
RUN CMAKE_ARGS="-DATTNSERVE_BUILD_TESTS=OFF -DATTNSERVE_REVISION=${REVISION}" \
    deploy/build.sh /src/build Release attnserve attnctl \
 && cmake --install /src/build --prefix /opt/attnserve --strip

# --- runtime: debian:12-slim with only the shared libraries the binaries load.
FROM debian:12-slim AS runtime
ARG VERSION=""
ARG REVISION=""
LABEL org.opencontainers.image.title="attnserve" \
      org.opencontainers.image.description="Multi-head attention as a gRPC service (oneDNN core, Prometheus metrics)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="debian:12-slim"
COPY deploy/install_deps.sh /tmp/install_deps.sh
RUN /tmp/install_deps.sh --runtime && rm -rf /var/lib/apt/lists/* /tmp/install_deps.sh \
 && groupadd --system --gid 10001 attnserve \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin attnserve \
 && mkdir /models
COPY --from=build /opt/attnserve /opt/attnserve
USER 10001:10001
# gRPC, and Prometheus metrics (--metrics_address)
EXPOSE 50051 9464
# SERVING once the model is loaded and warm, NOT_SERVING from the moment a
# shutdown starts. attnctl retries UNAVAILABLE within its 2 s deadline.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD ["/opt/attnserve/bin/attnctl", "health", "--target=127.0.0.1:50051", "--timeout_seconds=2"]
# SIGTERM: lame duck (--lame_duck_seconds, 1), then calls in flight finish
# (--drain_timeout_seconds, 25, from the signal): give `docker stop` -t 30.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/opt/attnserve/bin/attnserve"]
CMD ["--listen_address=0.0.0.0:50051", "--metrics_address=0.0.0.0:9464"]
