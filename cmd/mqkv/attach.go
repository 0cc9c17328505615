package main

import (
	"fmt"
	"net/url"
	"strings"

	"github.com/spf13/cobra"

	"github.com/mqkv/mqkv/internal/attach"
)

func attachCmd() *cobra.Command {
	n := newNodeFlags()
	var brokers []string
	var c conn // the client flags: --username, --password, --tls-*
	ac := attach.Config{}
	cmd := &cobra.Command{
		Use:   "attach --broker URL",
		Short: "Serve the state store to an MQTT v5 broker mqkv does not run (mosquitto, EMQX, HiveMQ)",
		Long: `Connects to an existing MQTT v5 broker as a client, takes the state store's
requests from it (a shared subscription to the request topic, so several
attached processes share them) and answers them as mqkv's own broker does:
the same bytes, the same store (durable in --data-dir, or --in-memory; the
cluster flags make several attached processes one cluster). The AIO SDKs'
state store, leases, locks and leader election then work through that broker.

mqkv cannot see who sent a request: it takes the requester's name from the
__srcId user property the SDKs send. Keep one client from publishing
requests in another's name, and from reading another's replies and
notifications, with the broker's ACLs (docs/attach.md has mosquitto and EMQX
examples). SIGHUP reloads --policy; SIGINT or SIGTERM stop the process.`,
		Example: `  mqkv attach --broker mqtt://127.0.0.1:1883
  mqkv attach --broker tls://broker:8883 --tls-ca ca.pem -u mqkv -p "$PW" --data-dir /var/lib/mqkv`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if len(brokers) == 0 {
				return fmt.Errorf("attach: --broker is required")
			}
			for _, b := range brokers {
				u, err := url.Parse(b)
				if err != nil || u.Host == "" {
					return fmt.Errorf("attach: --broker %q is not a URL (mqtt://host:1883, tls://, ws://, wss://)", b)
				}
				switch strings.ToLower(u.Scheme) {
				case "mqtt", "tcp":
					u.Scheme = "mqtt"
				case "tls", "mqtts", "ssl":
					u.Scheme = "tls"
				case "ws", "wss":
				default:
					return fmt.Errorf("attach: --broker %q: scheme %q (mqtt, tls, ws or wss)", b, u.Scheme)
				}
				ac.Brokers = append(ac.Brokers, u)
			}
			tc, err := c.tlsConfig()
			if err != nil {
				return fmt.Errorf("attach: %w", err)
			}
			ac.TLS, ac.Username, ac.ClientID = tc, c.username, c.clientID
			if c.password != "" {
				ac.Password = []byte(c.password)
			}
			n.cfg.Attach = &ac
			return n.run("attach")
		},
	}
	fs := cmd.Flags()
	fs.StringSliceVar(&brokers, "broker", nil, "the broker's `URL`: mqtt://host:1883, tls://host:8883, ws://host/mqtt or wss://; several (comma-separated) are tried in turn")
	c.identityFlags(fs, "this process's MQTT client `id` at the broker (default mqkv-<node id>, or the node id if it starts so); its persistent session is kept under it (env MQKV_CLIENT_ID)")
	fs.StringVar(&ac.Group, "share-group", attach.DefaultGroup, "shared subscription `group`: attached processes of one store take requests from $share/<group>/<request topic>")
	fs.Uint32Var(&ac.SessionExpiry, "session-expiry", attach.DefaultSessionExpiry, "`seconds` the broker keeps this process's session (and the requests sent to it) while it reconnects; in a cluster, another attached process takes up the session of one that died (docs/attach.md)")
	fs.Uint16Var(&ac.ReceiveMaximum, "receive-maximum", attach.DefaultReceiveMaximum, "requests the broker may send before this process acknowledges them (flow control)")
	fs.Uint16Var(&ac.KeepAlive, "keep-alive", attach.DefaultKeepAlive, "MQTT keep-alive in `seconds`")
	n.storeFlags(fs)
	return cmd
}
