# The container image: the static binary (CGO_ENABLED=0: it needs no libc
# and no file from the image) on an empty base. Build:
#   docker build -t mqkv .
# Run one node (data in a volume):
#   docker run -p 1883:1883 -v mqkv-data:/data mqkv
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/mqkv ./cmd/mqkv \
 && mkdir -p /out/data

FROM scratch
COPY --from=build /out/mqkv /mqkv
# The data directory, owned by the unprivileged user the server runs as.
COPY --from=build --chown=65532:65532 /out/data /data
USER 65532:65532
EXPOSE 1883 7000
ENTRYPOINT ["/mqkv", "serve", "--data-dir", "/data"]
# The admin endpoint has no authentication (backups hold every key): it
# stays on the container's loopback unless the arguments say otherwise
# (deploy/kubernetes/mqkv.yaml opens it to the kubelet's probes behind a
# NetworkPolicy).
CMD ["--listen", "0.0.0.0:1883", "--admin-listen", "127.0.0.1:8080"]
