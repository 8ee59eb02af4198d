# attnserve container: build with the project's own scripts, run slim and
# non-root. CI runs the same scripts (deploy/install_deps.sh, deploy/build.sh,
# deploy/check_runtime_deps.sh), since no Docker engine runs there.
#
#   docker build -t attnserve .
#   docker run -p 50051:50051 -p 9464:9464 attnserve

FROM debian:12 AS build
WORKDIR /src
COPY deploy/install_deps.sh deploy/
RUN deploy/install_deps.sh && rm -rf /var/lib/apt/lists/*
COPY . .
RUN CMAKE_ARGS="-DATTNSERVE_BUILD_TESTS=OFF" deploy/build.sh /src/build Release attnserve attnctl \
 && cmake --install /src/build --prefix /opt/attnserve --strip

FROM debian:12-slim AS runtime
COPY deploy/install_deps.sh /tmp/install_deps.sh
RUN /tmp/install_deps.sh --runtime && rm -rf /var/lib/apt/lists/* /tmp/install_deps.sh \
 && groupadd --system --gid 10001 attnserve \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin attnserve
COPY --from=build /opt/attnserve /opt/attnserve
USER 10001:10001
# gRPC, and Prometheus metrics (--metrics_address)
EXPOSE 50051 9464
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s \
  CMD ["/opt/attnserve/bin/attnctl", "health", "--target=127.0.0.1:50051", "--timeout_seconds=2"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["/opt/attnserve/bin/attnserve"]
CMD ["--listen_address=0.0.0.0:50051"]
