# Build:  docker build -t outboxd .
# Run:    docker run --rm outboxd --help
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked \
    && install -m 0755 target/release/outboxd /usr/local/bin/outboxd

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /usr/local/bin/outboxd /usr/local/bin/outboxd
USER nobody
ENTRYPOINT ["/usr/local/bin/outboxd"]
