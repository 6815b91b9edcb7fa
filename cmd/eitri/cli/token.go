package cli

import (
	"context"
	"fmt"
	"io"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/types/known/durationpb"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

func newTokenCmd(a *app) *cobra.Command {
	cmd := noun("token", "Mint and revoke API tokens; list and end console sessions",
		newTokenCreateCmd(a), newTokenListCmd(a), newTokenRevokeCmd(a), newSessionsCmd(a), newEndSessionCmd(a))
	a.addOutputFlag(cmd)
	return cmd
}

func newTokenCreateCmd(a *app) *cobra.Command {
	var ttl time.Duration
	var user string
	cmd := &cobra.Command{
		Use:   "create NAME",
		Short: "Mint a token (the secret is shown once)",
		Args:  needArgs("a NAME"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.dial()
			if err != nil {
				return err
			}
			req := &eitriv1.CreateTokenRequest{Name: args[0], UserName: user}
			if ttl > 0 {
				req.Ttl = durationpb.New(ttl)
			}
			r, err := c.token.CreateToken(cmd.Context(), connect.NewRequest(req))
			if err != nil {
				return apiError(err)
			}
			return c.show(r.Msg, func(w io.Writer) {
				fmt.Fprintf(w, "token %s for %s (shown once):\n\n  %s\n", r.Msg.Token.Id, r.Msg.Token.UserName, r.Msg.Secret)
			})
		},
	}
	cmd.Flags().DurationVar(&ttl, "ttl", 0, "lifetime (default: the server's)")
	cmd.Flags().StringVar(&user, "user", "", "admins: mint the token for this user (made if new)")
	return cmd
}

func newTokenListCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List tokens",
		Args:    NoArgs,
		RunE: a.withClient(func(ctx context.Context, c *client) error {
			r, err := c.token.ListTokens(ctx, connect.NewRequest(&eitriv1.ListTokensRequest{}))
			if err != nil {
				return apiError(err)
			}
			return c.show(r.Msg, func(w io.Writer) {
				fmt.Fprintln(w, "ID\tNAME\tUSER\tCREATED\tEXPIRES\tLAST USED")
				for _, t := range r.Msg.Tokens {
					fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\n", t.Id, t.Name, t.UserName, when(t.CreatedAt.AsTime()), whenPB(t.ExpiresAt, "never"), whenPB(t.LastUsedAt, "never"))
				}
			})
		}),
	}
}

func newTokenRevokeCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "revoke ID",
		Short: "Revoke a token at once",
		Args:  needArgs("a token id"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.dial()
			if err != nil {
				return err
			}
			if _, err := c.token.RevokeToken(cmd.Context(), connect.NewRequest(&eitriv1.RevokeTokenRequest{Id: args[0]})); err != nil {
				return apiError(err)
			}
			fmt.Fprintln(c.out, "revoked", args[0])
			return nil
		},
	}
}

// newSessionsCmd lists console sessions and the token each acts for.
func newSessionsCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "sessions",
		Short: "List console sessions and the token each acts for",
		Args:  NoArgs,
		RunE: a.withClient(func(ctx context.Context, c *client) error {
			r, err := c.token.ListSessions(ctx, connect.NewRequest(&eitriv1.ListSessionsRequest{}))
			if err != nil {
				return apiError(err)
			}
			return c.show(r.Msg, func(w io.Writer) {
				fmt.Fprintln(w, "ID\tUSER\tTOKEN\tCREATED\tEXPIRES\tLAST USED")
				for _, s := range r.Msg.Sessions {
					fmt.Fprintf(w, "%s\t%s\t%s (%s)\t%s\t%s\t%s\n", s.Id, s.UserName, s.TokenName, s.TokenId,
						when(s.CreatedAt.AsTime()), whenPB(s.ExpiresAt, "never"), whenPB(s.LastUsedAt, "never"))
				}
			})
		}),
	}
}

// newEndSessionCmd signs a console session out; its open pages lose their
// streams at once.
func newEndSessionCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "end-session ID",
		Short: "Sign a console session out (its open pages lose their streams at once)",
		Args:  needArgs("a session id"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.dial()
			if err != nil {
				return err
			}
			if _, err := c.token.RevokeSession(cmd.Context(), connect.NewRequest(&eitriv1.RevokeSessionRequest{Id: args[0]})); err != nil {
				return apiError(err)
			}
			fmt.Fprintln(c.out, "ended", args[0])
			return nil
		},
	}
}
