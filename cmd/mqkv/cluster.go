package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/mqkv/mqkv/internal/admin"
	"github.com/mqkv/mqkv/internal/cluster"
)

func clusterCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "cluster",
		Short: "See and change a cluster's membership (through a node's admin endpoint)",
	}
	cmd.AddCommand(clusterStatusCmd(), clusterLeaveCmd(), clusterRemoveCmd())
	return cmd
}

func clusterStatusCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Nodes, groups, leaders, partitions per node and migrations in progress",
		Example: `  mqkv cluster status --admin http://127.0.0.1:8081
  mqkv cluster status --json | jq '.nodes[] | select(.state != "alive")'`,
		Args: cobra.NoArgs,
	}
	base := adminURL(cmd.Flags())
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the status as JSON")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		ctx, cancel := context.WithTimeout(cmd.Context(), 30*time.Second)
		defer cancel()
		st, err := adminJSON[cluster.Status](ctx, *base, "/v1/cluster")
		if err != nil {
			return err
		}
		if asJSON {
			e := json.NewEncoder(cmd.OutOrStdout())
			e.SetIndent("", "  ")
			return e.Encode(st)
		}
		printCluster(cmd.OutOrStdout(), st)
		return nil
	}
	return cmd
}

func printCluster(w io.Writer, st cluster.Status) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NODE\tADDRESS\tSTATE\tLEADS\tREPLICAS\tPARTITIONS LED\tCLIENTS\tSESSIONS\tSUBSCRIPTIONS\tROUTE TABLE\tRELEASE\tPROTOCOLS")
	perGroup := 0
	if len(st.Groups) > 0 {
		perGroup = st.Groups[0].Partitions
	}
	for _, n := range st.Nodes {
		state := n.State
		if n.VolumeFull {
			state += ", volume full"
		}
		mq := "-\t-\t-\t-"
		if n.MQTT != nil {
			mq = fmt.Sprintf("%d\t%d\t%d\t%d", n.MQTT.Clients, n.MQTT.Sessions, n.MQTT.Subscriptions, n.MQTT.RouteFilters)
		}
		release := n.Release
		if release == "" {
			release = "(older)"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t~%d\t%s\t%s\t%d-%d\n", n.ID, n.Addr, state, n.Leads, n.Replicas, n.Leads*perGroup, mq, release, n.ProtoMin, n.ProtoMax)
	}
	tw.Flush()
	fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "GROUP\tLEADER\tREPLICAS\tPLACEMENT\tPARTITIONS\tMIGRATING")
	migrating := 0
	for _, g := range st.Groups {
		mark := ""
		if g.Migrating {
			mark = "yes"
			migrating++
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%s\n", g.ID, g.Leader, strings.Join(g.Replicas, ","), strings.Join(g.Placement, ","), g.Partitions, mark)
	}
	tw.Flush()
	fmt.Fprintf(w, "\n%d nodes, %d groups, %d migrating (as seen by %s); cluster protocol %d\n", len(st.Nodes), len(st.Groups), migrating, st.Node, st.Protocol)
	if st.NotMember {
		fmt.Fprintf(w, "%s is not a member of the cluster any more (it left, or was removed): the above is the cluster as it was then\n", st.Node)
	}
}

// adminPost sends a POST to the admin endpoint; any answer but 200 is an
// error with the endpoint's message.
func adminPost(ctx context.Context, base, path string) error {
	req, err := http.NewRequestWithContext(ctx, "POST", baseURL(base)+path, nil)
	if err != nil {
		return err
	}
	req.Header.Set(admin.RequestHeader, "1")
	resp, err := adminHTTP.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		var e struct{ Error string }
		json.NewDecoder(resp.Body).Decode(&e)
		return errors.New(e.Error)
	}
	return nil
}

func clusterLeaveCmd() *cobra.Command {
	var node string
	var wait time.Duration
	cmd := &cobra.Command{
		Use:   "leave",
		Short: "Drain a node (this one by default): its replicas move to the others, then it leaves the cluster",
		Example: `  mqkv cluster leave --admin http://127.0.0.1:8083        # the node behind that endpoint
  mqkv cluster leave --node n3                             # n3, through any node's endpoint`,
		Args: cobra.NoArgs,
	}
	base := adminURL(cmd.Flags())
	cmd.Flags().StringVar(&node, "node", "", "the `id` of the node to drain (default: the endpoint's own node)")
	cmd.Flags().DurationVar(&wait, "wait", 5*time.Minute, "how long to wait for the node to be drained (0: do not wait)")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		ctx, cancel := context.WithTimeout(cmd.Context(), wait+30*time.Second)
		defer cancel()
		if node == "" {
			st, err := fetchStatus(ctx, *base)
			if err != nil {
				return err
			}
			node = st.NodeID
		}
		if err := adminPost(ctx, *base, "/v1/cluster/leave?node="+url.QueryEscape(node)); err != nil {
			return fmt.Errorf("leave: %w", err)
		}
		fmt.Fprintf(os.Stderr, "%s is leaving: its replicas are moving to the other nodes\n", node)
		if wait == 0 {
			return nil
		}
		deadline := time.Now().Add(wait)
		for time.Now().Before(deadline) {
			time.Sleep(time.Second)
			resp, err := adminGet(ctx, *base, "/v1/cluster")
			if err != nil {
				continue // the endpoint may be the node that left
			}
			var st cluster.Status
			err = json.NewDecoder(resp.Body).Decode(&st)
			resp.Body.Close()
			if err != nil {
				continue
			}
			gone := true
			for _, n := range st.Nodes {
				if n.ID == node {
					gone = false
				}
			}
			if gone {
				fmt.Fprintf(os.Stderr, "%s has left the cluster; it can be stopped\n", node)
				return nil
			}
		}
		return fmt.Errorf("leave: %s still holds replicas after %s (see mqkv cluster status)", node, wait)
	}
	return cmd
}

func clusterRemoveCmd() *cobra.Command {
	var force bool
	cmd := &cobra.Command{
		Use:   "remove NODE-ID",
		Short: "Forget a dead node: its replicas are rebuilt on the survivors",
		Long: `Forgets a node that will not come back. Its replicas are replaced from the
surviving replicas of each group. A node that still answers is not removed:
'mqkv cluster leave' hands its data over first; --force removes it as it is.
A removed node is not let back in with its data: restarted, it is refused
(start it with an empty data directory, or with --rejoin).`,
		Example: `  mqkv cluster remove n3
  mqkv cluster remove --force n3     # even though n3 still answers`,
		Args: cobra.ExactArgs(1),
	}
	base := adminURL(cmd.Flags())
	cmd.Flags().BoolVar(&force, "force", false, "remove the node even if it answers (its data is not moved off it first)")
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		ctx, cancel := context.WithTimeout(cmd.Context(), 60*time.Second)
		defer cancel()
		path := "/v1/cluster/remove?node=" + url.QueryEscape(args[0])
		if force {
			path += "&force=1"
		}
		if err := adminPost(ctx, *base, path); err != nil {
			return fmt.Errorf("remove: %w", err)
		}
		fmt.Fprintf(os.Stderr, "%s removed; its replicas are being rebuilt on the other nodes\n", args[0])
		return nil
	}
	return cmd
}
