package main

import (
	"context"
	"crypto/tls"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"unicode/utf8"

	"github.com/eclipse/paho.golang/paho"
	"github.com/spf13/cobra"

	"github.com/mqkv/mqkv/internal/sockio"
)

// mqttSession connects a plain MQTT 5 client with the shared connection
// flags, for pub and sub: they speak MQTT itself, not the state store.
func (c *conn) mqttSession(ctx context.Context, onMessage func(*paho.Publish)) (*paho.Client, error) {
	s := c.server
	if !strings.Contains(s, "://") {
		s = "mqtt://" + s
	}
	u, err := url.Parse(s)
	if err != nil {
		return nil, fmt.Errorf("server URL %q: %w", c.server, err)
	}
	dctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	var nc net.Conn
	switch u.Scheme {
	case "mqtt", "tcp":
		nc, err = sockio.Dial(dctx, u.Host, nil)
	case "tls", "ssl", "mqtts":
		var tc *tls.Config
		if tc, err = c.tlsConfig(); err == nil {
			if tc == nil {
				tc = &tls.Config{MinVersion: tls.VersionTLS12}
			}
			nc, err = sockio.Dial(dctx, u.Host, tc)
		}
	default:
		return nil, fmt.Errorf("server URL %q: pub and sub speak mqtt:// and tls://", c.server)
	}
	if err != nil {
		return nil, err
	}
	pc := paho.NewClient(paho.ClientConfig{
		Conn: nc,
		OnPublishReceived: []func(paho.PublishReceived) (bool, error){func(pr paho.PublishReceived) (bool, error) {
			if onMessage != nil {
				onMessage(pr.Packet)
			}
			return true, nil
		}},
		OnClientError: func(error) {},
	})
	cp := &paho.Connect{ClientID: c.clientID, CleanStart: true, KeepAlive: 30}
	if c.username != "" {
		cp.UsernameFlag, cp.Username = true, c.username
	}
	if c.password != "" {
		cp.PasswordFlag, cp.Password = true, []byte(c.password)
	}
	ack, err := pc.Connect(dctx, cp)
	if err != nil {
		nc.Close()
		if ack != nil && ack.ReasonCode >= 0x80 {
			return nil, fmt.Errorf("connection refused: reason 0x%02x %s", ack.ReasonCode, reasonString(ack.Properties))
		}
		return nil, err
	}
	return pc, nil
}

func reasonString(p *paho.ConnackProperties) string {
	if p == nil {
		return ""
	}
	return p.ReasonString
}

func pubCmd() *cobra.Command {
	var c conn
	var qos int
	var retain bool
	var props []string
	var file, contentType string
	cmd := &cobra.Command{
		Use:   "pub TOPIC [MESSAGE]",
		Short: "Publish an MQTT message",
		Long: `Publishes MESSAGE (or the contents of --file, or standard input when neither
is given or MESSAGE is "-") to TOPIC. With QoS 1 or 2 it waits for the
broker's acknowledgement and fails if the broker refuses the message.`,
		Example: `  mqkv pub sensors/site-1/temp 21.5
  mqkv pub --qos 1 --retain config/site '{"mode":"auto"}'
  mqkv pub --user-property source=cli --content-type text/plain alerts/site-1 "door open"`,
		Args: cobra.RangeArgs(1, 2),
		RunE: func(_ *cobra.Command, args []string) error {
			if qos < 0 || qos > 2 {
				return fmt.Errorf("pub: --qos %d: want 0, 1 or 2", qos)
			}
			payload, err := content("pub", file, args)
			if err != nil {
				return err
			}
			pp := &paho.PublishProperties{ContentType: contentType}
			for _, p := range props {
				k, v, ok := strings.Cut(p, "=")
				if !ok {
					return fmt.Errorf("pub: --user-property %q: want KEY=VALUE", p)
				}
				pp.User.Add(k, v)
			}
			ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			pc, err := c.mqttSession(ctx, nil)
			if err != nil {
				return err
			}
			defer pc.Disconnect(&paho.Disconnect{})
			pctx, cancel := context.WithTimeout(ctx, c.timeout)
			defer cancel()
			r, err := pc.Publish(pctx, &paho.Publish{Topic: args[0], QoS: byte(qos), Retain: retain, Payload: payload, Properties: pp})
			if err != nil {
				if r != nil && r.ReasonCode >= 0x80 {
					return fmt.Errorf("pub: the broker refused the message: reason 0x%02x", r.ReasonCode)
				}
				return fmt.Errorf("pub: %w", err)
			}
			say(c, "OK")
			return nil
		},
	}
	c.flags(cmd.Flags())
	cmd.Flags().IntVarP(&qos, "qos", "q", 0, "quality of service: 0, 1 or 2")
	cmd.Flags().BoolVarP(&retain, "retain", "r", false, "ask the broker to retain the message")
	cmd.Flags().StringArrayVar(&props, "user-property", nil, "a `KEY=VALUE` user property (repeatable)")
	cmd.Flags().StringVar(&contentType, "content-type", "", "the message's content type")
	cmd.Flags().StringVarP(&file, "file", "f", "", "read the message from this file")
	return cmd
}

func subCmd() *cobra.Command {
	var c conn
	var qos, count int
	cmd := &cobra.Command{
		Use:   "sub FILTER...",
		Short: "Print the MQTT messages matching topic filters",
		Long: `Subscribes to each FILTER (+ and # wildcards, $share/group/... for a shared
subscription) and prints one line per message, "TOPIC PAYLOAD" (or JSON
lines with --json: topic, payload or payload_base64, qos, retain, user
properties), until interrupted or --count messages have arrived.`,
		Example: "  mqkv sub 'sensors/#'\n  mqkv sub --count 1 --json config/site | jq .payload",
		Args:    cobra.MinimumNArgs(1),
		RunE: func(_ *cobra.Command, args []string) error {
			if qos < 0 || qos > 2 {
				return fmt.Errorf("sub: --qos %d: want 0, 1 or 2", qos)
			}
			ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			msgs := make(chan *paho.Publish, 1024)
			quit := make(chan struct{})
			pc, err := c.mqttSession(ctx, func(p *paho.Publish) {
				select {
				case msgs <- p:
				case <-quit:
				}
			})
			if err != nil {
				return err
			}
			defer pc.Disconnect(&paho.Disconnect{})
			defer close(quit) // runs first: paho's Disconnect waits for a callback blocked on msgs
			subs := make([]paho.SubscribeOptions, len(args))
			for i, f := range args {
				subs[i] = paho.SubscribeOptions{Topic: f, QoS: byte(qos)}
			}
			sctx, cancel := context.WithTimeout(ctx, c.timeout)
			ack, err := pc.Subscribe(sctx, &paho.Subscribe{Subscriptions: subs})
			cancel()
			if ack != nil {
				for i, code := range ack.Reasons {
					if code >= 0x80 && i < len(args) {
						return fmt.Errorf("sub: the broker refused %s: reason 0x%02x", args[i], code)
					}
				}
			}
			if err != nil {
				return fmt.Errorf("sub: %w", err)
			}
			for n := 0; count <= 0 || n < count; n++ {
				select {
				case <-ctx.Done():
					return nil
				case <-pc.Done():
					return errors.New("sub: the broker ended the connection")
				case p := <-msgs:
					printMessage(c.json, p)
				}
			}
			return nil
		},
	}
	c.flags(cmd.Flags())
	cmd.Flags().IntVarP(&qos, "qos", "q", 0, "maximum quality of service: 0, 1 or 2")
	cmd.Flags().IntVarP(&count, "count", "C", 0, "exit after this many messages (0: never)")
	return cmd
}

func printMessage(asJSON bool, p *paho.Publish) {
	if !asJSON {
		fmt.Printf("%s %s\n", p.Topic, p.Payload)
		return
	}
	out := map[string]any{"topic": p.Topic, "qos": p.QoS, "retain": p.Retain}
	if utf8.Valid(p.Payload) {
		out["payload"] = string(p.Payload)
	} else {
		out["payload_base64"] = base64.StdEncoding.EncodeToString(p.Payload)
	}
	if p.Properties != nil && len(p.Properties.User) > 0 {
		user := map[string]string{}
		for _, u := range p.Properties.User {
			user[u.Key] = u.Value
		}
		out["user_properties"] = user
	}
	printJSON(out)
}
