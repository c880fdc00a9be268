from environments.locker import Locker, LETTERS

class DistinctLocker(Locker):
    def reset(self, *, seed=None, options=None):
        prompt, info = super().reset(seed=seed, options=options)
        self.digits = [int(d) for d in self.np_random.permutation(10)[:self.lockers]]
        self.answer = self.digits[self.locker - 1]
        return prompt, {"locker": self.locker, "answer": self.answer}
