package agent

import (
	"context"
	"errors"
	"log/slog"

	"github.com/a73x/eitri/agent/state"
	"github.com/a73x/eitri/agent/syncclient"
)

// identity loads this host's enrollment, or enrolls with the join token and
// keeps what that bought before anything uses it.
func identity(ctx context.Context, st *state.Store, cfg Config, log *slog.Logger) (state.Identity, error) {
	saved, ok, err := st.LoadIdentity()
	if err != nil {
		return state.Identity{}, err
	}
	if ok {
		if cfg.JoinToken != "" {
			log.Warn("already enrolled; ignoring --join", "host", saved.HostID)
		}
		return saved, nil
	}
	tok := cfg.JoinToken
	if tok == "" && cfg.MintJoinToken != nil {
		if tok, err = cfg.MintJoinToken(ctx); err != nil {
			return state.Identity{}, err
		}
	}
	if tok == "" {
		return state.Identity{}, errors.New("this host is not enrolled: run it once with --join <token> (eitri host join-token prints one)")
	}
	id, err := syncclient.Enroll(ctx, tok, cfg.Name, cfg.Version)
	if err != nil {
		return state.Identity{}, err
	}
	if err := st.SaveIdentity(id); err != nil {
		return state.Identity{}, err
	}
	return id, nil
}
