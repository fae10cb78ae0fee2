# A non-root image holding the ratelimitd binary and nothing else of ours.
#   docker build -t ratelimitd .
# The build stage runs what `make build` runs (cargo build --release). The runtime stage is
# Debian's slim image (the binary needs only glibc); it runs as an unprivileged user and needs
# no writable filesystem. A distroless "cc" base works the same and is smaller.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto ./proto
COPY src ./src
COPY benches ./benches
RUN cargo build --release --locked --bin ratelimitd

FROM debian:bookworm-slim
COPY --from=build /src/target/release/ratelimitd /usr/local/bin/ratelimitd
# Envoy Gateway starts the rate-limit container as /bin/ratelimit (envoyproxy/ratelimit's
# path), whatever the image: the same binary answers there.
RUN ln -s /usr/local/bin/ratelimitd /bin/ratelimit
USER 65532:65532
EXPOSE 8080 8081 6070
ENTRYPOINT ["/usr/local/bin/ratelimitd"]
