"""scripts/synth_videos: the square shows exactly during events; both motions keep it inside the frame."""
import numpy as np
import pytest

from scripts.synth_videos import BOUNCE_PX_S, COLORS, VideoSpec, event_specs, render_frame


def square_columns(spec, i):
    texture = np.zeros((spec.height + 8, spec.width * 2 + 8, 3), np.uint8)  # black: only the square is bright
    cols = np.where(render_frame(spec, i, texture).max(axis=(0, 2)) > 200)[0]
    return (int(cols.min()), int(cols.max())) if len(cols) else None


@pytest.mark.parametrize("motion", ["sweep", "bounce"])
def test_square_only_during_events_and_inside_the_frame(motion):
    spec = VideoSpec(name="v", duration_s=8.0, fps=10.0, width=128, height=64, square_frac=0.75,
                     events=((1.0, 3.0), (5.0, 7.5)), motion=motion, seed=3)
    for i in range(80):
        t, cols = i / 10, square_columns(spec, i)
        visible = 1.0 <= t < 3.0 or 5.0 <= t < 7.5
        assert (cols is not None) == visible, (t, cols)
        if cols:
            assert cols[0] >= 0 and cols[1] <= 127 and cols[1] - cols[0] + 1 == 48


def test_sweep_crosses_the_frame_and_bounce_moves_at_constant_speed():
    sweep = VideoSpec(name="v", width=128, height=64, square_frac=0.75, events=((1.0, 5.0),), motion="sweep")
    assert square_columns(sweep, 10)[0] == 0 and square_columns(sweep, 49)[0] > 70  # left edge -> right edge
    bounce = VideoSpec(name="v", width=128, height=64, square_frac=0.75, events=((1.0, 5.0),), motion="bounce", seed=3)
    xs = [square_columns(bounce, i)[0] for i in range(10, 50)]
    steps = [abs(b - a) for a, b in zip(xs, xs[1:])]
    per_frame = BOUNCE_PX_S / 10
    assert all(s <= per_frame + 1 for s in steps)  # never faster (a reflection only shortens a step)
    assert sum(abs(s - per_frame) <= 1 for s in steps) >= 0.8 * len(steps)  # constant speed between walls
    assert max(xs) - min(xs) > 40  # it really moves


def test_duration_range_draws_whole_seconds_without_changing_fixed_sets():
    mixed = event_specs(20, seed=5, duration_range=(16.0, 32.0))
    assert {s.duration_s for s in mixed} <= set(map(float, range(16, 33))) and len({s.duration_s for s in mixed}) > 3
    assert event_specs(3, seed=5, duration_s=24.0) == event_specs(3, seed=5)  # the fixed-length sets are as before


def test_rotate_colors_opens_videos_with_every_color_and_leaves_default_sets_red():
    def first_color(spec):
        texture = np.zeros((spec.height + 8, spec.width * 2 + 8, 3), np.uint8)
        frame = render_frame(spec, int(spec.events[0][0] * spec.fps) + 1, texture)
        return tuple(int(c) for c in frame[frame.max(axis=2) > 200][0])

    rotated = [s for s in event_specs(30, seed=5, duration_range=(16.0, 32.0), rotate_colors=True) if s.events]
    assert {first_color(s) for s in rotated} == set(COLORS)
    assert all(first_color(s) == COLORS[int(s.name[-4:]) % 3] for s in rotated)
    plain = event_specs(30, seed=5, duration_range=(16.0, 32.0))
    assert {first_color(s) for s in plain if s.events} == {COLORS[0]}  # held-out sets: as before
    assert [s.events for s in plain] == [s.events for s in event_specs(30, seed=5, duration_range=(16.0, 32.0),
                                                                         rotate_colors=True)]  # same event times
