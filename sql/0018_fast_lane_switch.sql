-- 0018: an operator can turn the ready lane off, and it stays off. Going back to a release before
-- 0015 needs the lane empty, and until now only a manual UPDATE of settings.fast_lane turned it
-- off — which the next relay of this version to start turned on again (use_fast_lane). The
-- command `outbox-relay lane off` sets `fast_lane_off` through set_fast_lane, which use_fast_lane
-- respects, then waits for the transactions that may still write to the lane and for the lane
-- to drain (see relay/admin.py, and CHANGELOG.md for the procedure).
--
-- Upgrading: adds a column with a constant default (no rewrite) and replaces use_fast_lane with
-- the same signature; relays of either version are unaffected. set_fast_lane is the schema
-- owner's: `migrate` revokes EXECUTE from PUBLIC, and no role is granted it.

SET LOCAL lock_timeout = '10s';
ALTER TABLE settings ADD COLUMN fast_lane_off boolean NOT NULL DEFAULT false;

CREATE OR REPLACE FUNCTION use_fast_lane() RETURNS void
LANGUAGE sql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
    UPDATE settings SET fast_lane = true WHERE NOT fast_lane AND NOT fast_lane_off
$$;

-- Turn the ready lane on or off for producers. Off: producers write to `messages` from the next
-- transaction that reads the settings (one whose snapshot is older still writes to the lane),
-- and relays of this version no longer turn it on when they start. On: only while relays of
-- this version run (they alone read the lane). Returns the row as it now is.
CREATE FUNCTION set_fast_lane(p_on boolean, OUT fast_lane boolean, OUT fast_lane_off boolean)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
BEGIN
    IF p_on IS NULL THEN
        RAISE EXCEPTION 'set_fast_lane: on or off, not NULL' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE settings s SET fast_lane = p_on, fast_lane_off = NOT p_on
    RETURNING s.fast_lane, s.fast_lane_off INTO fast_lane, fast_lane_off;
END;
$$;
