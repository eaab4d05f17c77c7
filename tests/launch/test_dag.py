import pytest

from hobson.errors import StageError
from hobson.launch import dag
from hobson.launch.options import RecipeConfig


def ctx(ngpu=4, rows=None):
    return dag.PlanContext(run_dir="/r", ngpu=ngpu, config=RecipeConfig(), seed=0,
                           expected_rows=lambda rel: rows)


def test_named_stages_run_in_dag_order_with_derived_dependencies():
    jobs = dag.plan(["teacher", "multistep", "build"], ctx(), absent=lambda rel: 'nothing')
    names = [j.name for j in jobs]
    assert names.index("multistep") < names.index("teacher") < names.index("teacher-merge")
    merge = jobs[names.index("teacher-merge")]
    assert "teacher" in merge.after and "build" in merge.after
    assert jobs[names.index("teacher")].after == ["multistep"]


def test_teacher_is_an_array_of_ngpu_whole_batch_shards():
    jobs = {j.name: j for j in dag.plan(["build", "multistep", "teacher"], ctx(ngpu=4), lambda rel: 'nothing')}
    t = jobs["teacher"]
    assert t.shards == [0, 1, 2, 3] and t.num_shards == 4 and t.throttle == 4
    assert t.resources.gpus == 1
    assert "labels/teacher.shard{shard}of4.jsonl" in t.outputs


def test_missing_input_is_refused_naming_it():
    with pytest.raises(StageError, match="teacher: needs data/multistep/train.jsonl: nothing"):
        dag.plan(["teacher"], ctx(), absent=lambda rel: 'nothing')


def test_present_input_with_recorded_digest_is_accepted():
    jobs = dag.plan(["teacher"], ctx(), absent=lambda rel: None)
    assert [j.name for j in jobs] == ["teacher", "teacher-merge"]
    assert jobs[0].after == []


def test_unknown_stage_lists_the_stages():
    with pytest.raises(StageError, match="unknown stage 'teach'.*teacher"):
        dag.plan(["teach"], ctx(), absent=lambda rel: 'nothing')


def test_all_expands_to_every_stage_once():
    jobs = dag.plan(["all", "build"], ctx(), absent=lambda rel: 'nothing')
    assert sorted({j.stage for j in jobs}) == sorted(dag.ALL)
    assert len({j.name for j in jobs}) == len(jobs)


def test_expected_rows_are_declared_on_outputs():
    jobs = {j.name: j for j in dag.plan(["all"], ctx(rows=7), lambda rel: 'nothing')}
    assert "data/build/train.jsonl=7" in jobs["build"].outputs
    assert "labels/teacher.jsonl=7" in jobs["teacher-merge"].outputs


def test_every_job_is_a_list_of_components():
    """A recipe stage is one component (its tasks: the array's shards, or one); the RL run is
    training plus rollout, one task per rollout server, each with its own resources."""
    jobs = {j.name: j for j in dag.plan(["build", "multistep", "teacher"], ctx(ngpu=4), lambda rel: 'nothing')}
    (teacher,) = jobs["teacher"].parts
    assert (teacher.name, teacher.tasks, teacher.resources) == ("teacher", 4, jobs["teacher"].resources)
    (build,) = jobs["build"].parts
    assert build.tasks == 1 and not jobs["build"].heterogeneous
    rl = dag.rl_job(["--algorithm", "ppo"], [], train_gpus=2, rollout_gpus=1, rollout_servers=3)
    assert rl.heterogeneous and [(c.name, c.tasks, c.resources.gpus) for c in rl.parts] == [
        (dag.RL_TRAINING, 1, 2), (dag.RL_ROLLOUT, 3, 1)]


def test_rl_processes_are_the_servers_then_the_trainer_pointed_at_them():
    """What the local backend starts for an RL job: one rollout server per rollout task (index i
    writes address i), and the trainer's flags naming them; none where the engine runs in process."""
    rl = dag.rl_job(["--algorithm", "ppo", "--output", "/r/rl", "--engine-device", "cuda:1"], [], rollout_servers=3)
    plan = dag.rl_processes(rl, "local-7", device_per_server=True)
    assert plan.address == "/r/rl/engine/address-local-7-{index}.json"
    assert [s[s.index("--index") + 1] for s in plan.servers] == ["0", "1", "2"]
    assert {s[s.index("--device") + 1] for s in plan.servers} == {"cuda"}  # each sees only its own GPU
    assert plan.trainer_args[-4:] == ["--engine-address-file", plan.address, "--rollout-servers", "3"]
    one = dag.rl_processes(dag.rl_job(["--output", "o", "--device", "cuda:0"], []), "t")
    assert one.address == "o/engine/address-t.json" and one.servers[0][-5] == "cuda:0"  # shared GPUs: as given
    assert dag.rl_processes(dag.rl_job(["--output", "o", "--engine", "vllm"], []), "t") is None
    assert dag.rl_processes(dag.rl_job(["--output", "o", "--engine-address-file", "a.json"], []), "t") is None
