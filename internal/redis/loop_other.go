//go:build !linux

package redis

import (
	"net"

	"github.com/mqkv/mqkv/internal/gateway"
)

// ServeLoop serves ln's connections; outside Linux, each on a goroutine
// of its own (gateway.Serve), as there is no epoll loop there.
func (s *Server) ServeLoop(ln net.Listener) (Endpoint, error) {
	return gateway.Serve(ln, s.Serve), nil
}
