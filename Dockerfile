# Build:  docker build -t outboxd .
# Run:    docker run --rm outboxd --help
# Two stages: the Rust toolchain builds the relay and the example consumer; the runtime image is
# distroless (glibc, libgcc, CA certificates, no shell, no package manager), about 25 MB plus
# the two binaries. Healthchecks call `outboxd health` (no curl or wget needed).
FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock build.rs ./
COPY src ./src
COPY benches ./benches
COPY examples ./examples
COPY migrations ./migrations
# The image has no .git: pass the commit for `outboxd --version`
# (docker build --build-arg OUTBOXD_COMMIT=$(git rev-parse --short=12 HEAD) .).
ARG OUTBOXD_COMMIT=unknown
ENV OUTBOXD_COMMIT=${OUTBOXD_COMMIT}
RUN cargo build --release --locked --bin outboxd --example invoice_projection \
    && install -m 0755 target/release/outboxd /usr/local/bin/outboxd \
    && install -m 0755 target/release/examples/invoice_projection /usr/local/bin/invoice_projection

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /usr/local/bin/outboxd /usr/local/bin/outboxd
COPY --from=build /usr/local/bin/invoice_projection /usr/local/bin/invoice_projection
USER nonroot
ENTRYPOINT ["/usr/local/bin/outboxd"]
